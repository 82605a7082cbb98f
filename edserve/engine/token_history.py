"""Sampled tokens per ``req_to_token`` row, kept on the device.

The sampler appends each step's tokens here (a device scatter), the next decode step reads its
input ids from here, and logits filters read whole histories from here, so no token has to
visit the host between steps: the host learns the tokens one step later, from the step's single
device->host copy (see :class:`~edserve.engine.step.StepOutput`).

Layout (row 0 is the padding row, as in ``req_to_token``)::

    tokens   int64 [rows + 1, max_tokens]   row r: tokens sampled by the request holding r
    lengths  int64 [rows + 1]               valid entries of each row
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edserve.engine.host_copy import to_device


@dataclass
class HistoryEdits:
    """Host-recorded row edits from row groups (beam reordering), applied before the next step:
    first ``dst[i] = src[i]`` (whole rows, gathered before any write), then the last token of
    ``last_rows[i]`` becomes ``last_tokens[i]`` (it replaces the token the sampler appended)."""

    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    last_tokens: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copy_dst or self.last_rows)


class TokenHistory:
    def __init__(self, rows: int, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.tokens = torch.zeros(rows + 1, max_tokens, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(rows + 1, dtype=torch.int64, device=device)

    def reset(self, rows: torch.Tensor) -> None:
        """Empty ``rows`` ([B] int64 device) for newly admitted requests."""
        self.lengths.index_fill_(0, rows, 0)

    def append(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append ``tokens[i]`` to row ``rows[i]`` ([B] int64 each; device ops only).

        A row already full keeps its last column overwritten (that request is at its length
        limit and finishes at this step). Lengths are set, not added to, so a row listed more
        than once (the padding row 0 of a graph-replayed step) stays within ``max_tokens``."""
        cur = self.lengths[rows]  # [B]
        self.tokens[rows, cur.clamp(max=self.max_tokens - 1)] = tokens
        self.lengths[rows] = (cur + 1).clamp(max=self.max_tokens)

    def last(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] the most recent token of each row (the next decode step's input ids)."""
        col = (self.lengths[rows] - 1).clamp(min=0)
        return self.tokens[rows, col]

    def apply(self, edits: HistoryEdits, device: torch.device) -> None:
        """Carry out ``edits`` with device ops (one upload, no sync)."""
        nc, nl = len(edits.copy_dst), len(edits.last_rows)
        idx = to_device(edits.copy_src + edits.copy_dst + edits.last_rows + edits.last_tokens,
                        torch.int64, device)
        if nc:
            src, dst = idx[:nc], idx[nc:2 * nc]
            self.tokens[dst] = self.tokens[src]
            self.lengths[dst] = self.lengths[src]
        if nl:
            rows, toks = idx[2 * nc:2 * nc + nl], idx[2 * nc + nl:]
            col = (self.lengths[rows] - 1).clamp(min=0)
            self.tokens[rows, col] = toks

    def reorder(self, rows: torch.Tensor, parents: torch.Tensor, last: torch.Tensor) -> None:
        """Row ``rows[i]`` takes row ``parents[i]``'s history with its last token replaced by
        ``last[i]`` ([P] int64 each; every read before any write; device ops only)."""
        toks = self.tokens.index_select(0, parents)  # [P, max_tokens]
        lens = self.lengths.index_select(0, parents)
        toks.scatter_(1, (lens - 1).clamp(min=0)[:, None], last[:, None])
        self.tokens.index_copy_(0, rows, toks)
        self.lengths.index_copy_(0, rows, lens)

    def common_prefix(self, rows: torch.Tensor, others: torch.Tensor,
                      upto: torch.Tensor) -> torch.Tensor:
        """[P] how many leading tokens row ``rows[i]`` shares with row ``others[i]``, counting
        at most ``upto[i]`` columns ([P] int64 each; device ops only)."""
        a = self.tokens.index_select(0, rows)  # [P, max_tokens]
        b = self.tokens.index_select(0, others)
        col = torch.arange(self.max_tokens, device=a.device)[None, :]
        differ = (a != b) | (col >= upto[:, None])  # [P, max_tokens]; True at `upto` at least
        first = torch.where(differ, col, self.max_tokens).amin(1)
        return torch.minimum(first, upto.clamp(min=0))

    def view(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(history [B, max_tokens], lengths [B]) of ``rows``."""
        return self.tokens[rows], self.lengths[rows]
