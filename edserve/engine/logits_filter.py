"""The logits-filter interface: batched edits of next-token logits before sampling.

A request lists its filters in ``GenerateRequest.logits_processors``. Once per step the sampler
groups the batch's rows by their filter list (lists that compare equal share a group) and calls
each filter of a group once, in list order, on that group's ``[n, V]`` logits. Filters are
therefore written as tensor ops over rows: no Python loop per request and no host<->device sync
(never ``if tensor:``, ``.item()``, ``.tolist()``, or ``t[idx] = python_scalar`` on a device).
The one exception is a grammar (:mod:`edserve.chat.grammar_filter`): its matcher lives on the
host and must see each sampled token, so it reads its row once per step (never capturable).

Value-typed filters (frozen dataclasses whose fields are the settings) compare equal across
requests, so every Whisper window of every request that uses the same settings is filtered in
one call. A filter that must see one request only (a test recorder) keeps identity equality.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from edserve.engine.host_copy import to_device


@dataclass
class FilterContext:
    """What a filter may read about its group's rows (all on the logits' device)."""

    history: torch.Tensor  # [n, C] int64: tokens sampled so far per row (prompt excluded)
    lengths: torch.Tensor  # [n] int64: valid entries of each history row
    rids: tuple[str, ...]  # the rows' request ids, in row order (host; for recorders)
    # [n] bool a filter may set (``ctx.greedy |= cond``) to make those rows choose greedily at
    # this step even when their request samples; None when no row of the batch samples.
    greedy: torch.Tensor | None = None

    def last(self, back: int = 1) -> torch.Tensor:
        """[n] the ``back``-th last sampled token of each row (-1 where there is none)."""
        idx = (self.lengths - back).clamp(min=0)[:, None]
        tok = self.history.gather(1, idx)[:, 0]
        return torch.where(self.lengths >= back, tok, torch.full_like(tok, -1))


class LogitsFilter(ABC):
    """Edits ``logits`` ``[n, V]`` (float32) of one group of rows in place."""

    #: True when ``apply`` is tensor ops only, with no host-side effect and no input but its
    #: arguments and its own settings, so a CUDA graph may capture it once and replay it
    #: (:mod:`edserve.engine.sample_graphs`); False (the default) keeps it eager every step.
    capturable: bool = False

    #: True for a filter that holds one request's state (a grammar's matcher). Rows whose
    #: filter lists differ only in such instances of one class share a group, and that class's
    #: :meth:`apply_rows` is called once for them with every row's own instance.
    per_row: bool = False

    @abstractmethod
    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        """In place; tensor ops only (see the module doc)."""

    @classmethod
    def apply_rows(cls, filters: list[LogitsFilter], logits: torch.Tensor,
                   ctx: FilterContext) -> None:
        """``per_row`` filters only: edit ``logits`` ``[n, V]`` of a group in place, where
        ``filters[i]`` is row ``i``'s instance."""
        raise NotImplementedError(f"{cls.__name__} sets per_row but has no apply_rows")

    def bind(self, tokenizer: Any, rows: int) -> None:  # noqa: B027 (optional hook)
        """Called by the engine each time the request is validated or added, before it is
        queued, with the engine's tokenizer and the request's row count (its beams or
        ``best_of``): a filter that needs the vocabulary (a grammar) prepares itself here and
        raises ``ValueError`` to refuse the request. Default: nothing to prepare."""


def filter_cache() -> dict:
    """A value-typed filter's field for the device tensors it builds once (masks, ids): left
    out of equality and repr, so equal settings still compare equal."""
    return field(default_factory=dict, compare=False, repr=False)


def vocab_mask(ids: tuple[int, ...], vocab: int, device: torch.device,
               cache: dict) -> torch.Tensor:
    """``[V]`` bool, True at ``ids`` (ids outside ``0..V-1`` ignored). Built once per
    (V, device) and kept in the calling filter's ``cache`` (one upload, then none)."""
    key = (vocab, str(device))
    mask = cache.get(key)
    if mask is None:
        mask = torch.zeros(vocab, dtype=torch.bool, pin_memory=device.type == "cuda")
        mask[[i for i in ids if 0 <= i < vocab]] = True
        mask = cache[key] = mask.to(device, non_blocking=True)  # no wait for the stream
    return mask


def vocab_ids(ids: tuple[int, ...], vocab: int, device: torch.device,
              cache: dict) -> torch.Tensor:
    """``[K]`` int64, the distinct ``ids`` inside ``0..V-1`` in ascending order, for filters
    that touch only their columns (``index_fill_``: K x rows elements, not V x rows). Built
    once per (V, device) and kept in the calling filter's ``cache``."""
    key = ("ids", vocab, str(device))
    found = cache.get(key)
    if found is None:
        found = cache[key] = to_device(sorted({i for i in ids if 0 <= i < vocab}),
                                       torch.int64, device)
    return found


class LogitsRecorder(LogitsFilter):
    """Keeps a copy of every logits row it is shown, unchanged (tests and debugging).

    One instance per request: it compares by identity, so it forms its own group and each
    ``apply`` sees that request's single row. ``rows`` holds ``[V]`` tensors on the device.
    """

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        self.rows.extend(logits.detach().clone().unbind(0))
