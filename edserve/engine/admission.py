"""Admission: which waiting requests a step admits (:func:`admit`), and admission batching.

:func:`admit` takes waiting requests in arrival order while their worst case fits: rows free
(beam/best_of groups take ``group.size`` rows), KV slots free after what running requests were
promised and have not taken yet (:func:`outstanding`), and at most ``max_prefill_tokens``
encoder + prompt tokens in one step, ``max_mixed_prefill_tokens`` when rows are running (their
decoding waits for the step: a mixed step); one request is always admitted. The first request that
does not fit stops admission (no overtaking: arrival order is kept).

Admission batching (:class:`AdmissionPolicy`): hold arrivals briefly while rows decode, so they
share a prefill step.

A prefill step has a fixed cost whatever its size (the encoder at batch 1 runs far below the
matmul rate; the prompt takes one decode-graph replay per position; every decoding row waits
for the step), so a server that admits each arrival at the next step pays that cost per request
under streaming arrivals, while the same requests submitted together share it. With
``wait_s > 0`` a step admits nothing while (a) rows are decoding, (b) fewer than ``batch``
requests wait (or fewer than the free rows, whichever is less) and (c) the oldest waiting
request arrived less than ``wait_s`` ago. Decoding goes on meanwhile, so no row waits more
than it does today; an arrival waits at most ``wait_s`` longer. Nothing is held when nothing
decodes (a lone request is admitted at once).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edserve.engine.group_ops import held_at_least


@dataclass(frozen=True)
class AdmissionPolicy:
    wait_s: float = 0.0  # 0: admit every arrival at the next step
    batch: int = 8  # admit at once when this many wait

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.batch < 1:
            raise ValueError(f"admission wait must be >= 0 and batch >= 1, got "
                             f"{self.wait_s} s / {self.batch}")

    def hold(self, waiting: Sequence[Any], num_running: int, free_rows: int,
             now: float | None = None) -> bool:
        """True when this step should admit nothing (see the module doc). ``waiting``: the
        queue, oldest first, items with ``submitted_at`` (``time.perf_counter``)."""
        if self.wait_s <= 0 or not waiting or num_running == 0:
            return False
        if len(waiting) >= min(self.batch, max(1, free_rows)):
            return False
        now = time.perf_counter() if now is None else now
        return now - waiting[0].submitted_at < self.wait_s


def outstanding(running: Sequence[Any], page_size: int) -> tuple[int, int]:
    """(KV slots, rows) promised to ``running`` requests and not taken yet. A group's pages
    are at least its longest row's own pages (its other rows may share them)."""
    slots = rows = 0
    seen: set[int] = set()
    for r in running:
        if r.group is None:
            slots += r.reserved_slots - held_at_least(r, r.row_len, page_size)
        elif r.group.id not in seen:
            seen.add(r.group.id)
            g = r.group
            longest = max(m.row_len for m in g.members)
            slots += max(0, g.leader.reserved_slots
                         - held_at_least(g.leader, longest, page_size))
            rows += g.size - len(g.members)
    return slots, rows


def admit(waiting: deque, running: Sequence[Any], pools: Any, limits: Any) -> list[Any]:
    """Pop and return the requests to admit now (see the module doc); ``limits`` is the
    scheduler's ``SchedulerLimits``."""
    if not waiting:
        return []
    owed_slots, owed_rows = outstanding(running, pools.kv_pool.page_size)
    budget = pools.allocator.available_size() - owed_slots
    rows = min(pools.req_to_token_pool.available_size(),
               limits.max_running_requests - len(running)) - owed_rows
    if limits.admission.hold(waiting, len(running), rows):
        return []
    tokens = 0
    limit = min(limits.max_prefill_tokens, limits.max_mixed_prefill_tokens) if running \
        else limits.max_prefill_tokens
    admitted: list[Any] = []
    while waiting:
        req = waiting[0]
        need = req.enc_region + len(req.prompt_ids)
        size = req.group.size if req.group is not None else 1
        if size > rows or req.reserved_slots > budget or (
                admitted and tokens + need > limit):
            break  # back-pressure: wait for running requests to free KV
        admitted.append(waiting.popleft())
        budget -= req.reserved_slots
        rows -= size
        tokens += need
    return admitted
