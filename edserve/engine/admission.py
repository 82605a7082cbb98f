"""Admission batching: hold arrivals briefly while rows decode, so they share a prefill step.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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
