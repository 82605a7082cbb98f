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

import torch


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
        limit and finishes at this step)."""
        col = self.lengths[rows].clamp(max=self.max_tokens - 1)  # [B]
        self.tokens[rows, col] = tokens
        self.lengths.index_add_(0, rows, (self.lengths[rows] < self.max_tokens).long())

    def last(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] the most recent token of each row (the next decode step's input ids)."""
        col = (self.lengths[rows] - 1).clamp(min=0)
        return self.tokens[rows, col]

    def view(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(history [B, max_tokens], lengths [B]) of ``rows``."""
        return self.tokens[rows], self.lengths[rows]
