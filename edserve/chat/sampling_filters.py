"""OpenAI's chat sampling knobs as logits filters (:mod:`edserve.engine.logits_filter`):
``logit_bias`` and the ``frequency_penalty`` / ``presence_penalty`` pair.

Both are frozen dataclasses of their settings, so requests with equal settings are filtered
in one call, and tensor ops only (no host sync; capturable by the sampling graphs). As in
vLLM, the penalties count the tokens generated so far (``ctx.history``; the prompt is not
counted): ``logits -= frequency * count + presence * (count > 0)``. The bias is added to its
tokens' logits before any penalty (the order filters are listed in by :func:`chat_filters`).
The engine's log-probabilities (``logprobs``) are taken after these filters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from edserve.engine.host_copy import to_device
from edserve.engine.logits_filter import FilterContext, LogitsFilter, filter_cache

BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value
PENALTY_LIMIT = 2.0  # OpenAI's range for frequency_penalty and presence_penalty


@dataclass(frozen=True)
class LogitBias(LogitsFilter):
    """Adds ``bias`` (``((token_id, value), ...)``, ids ascending) to those tokens' logits."""

    capturable = True

    bias: tuple[tuple[int, float], ...]
    _tensors: dict = filter_cache()

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        key = str(logits.device)
        found = self._tensors.get(key)
        if found is None:
            ids = to_device([i for i, _ in self.bias], torch.int64, logits.device)
            values = to_device([v for _, v in self.bias], torch.float32, logits.device)
            found = self._tensors[key] = (ids, values)
        ids, values = found  # [K], [K]
        logits.index_add_(1, ids, values[None, :].expand(logits.shape[0], -1))


@dataclass(frozen=True)
class RepetitionPenalties(LogitsFilter):
    """OpenAI's ``frequency_penalty`` and ``presence_penalty`` over the generated tokens."""

    capturable = True

    frequency: float
    presence: float

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        cols = ctx.history.shape[1]  # history [n, C]
        valid = torch.arange(cols, device=logits.device)[None, :] < ctx.lengths[:, None]
        tokens = ctx.history.clamp(0, logits.shape[1] - 1)  # [n, C] (padding: masked below)
        counts = torch.zeros_like(logits).scatter_add_(1, tokens, valid.to(logits.dtype))
        logits.sub_(counts * self.frequency + (counts > 0).to(logits.dtype) * self.presence)


def chat_filters(logit_bias: Mapping[int, float] | None = None, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0) -> list[LogitsFilter]:
    """The filters a chat request lists (none for the defaults); values must already be in
    range (the server checks them)."""
    out: list[LogitsFilter] = []
    if logit_bias:
        out.append(LogitBias(tuple(sorted((int(k), float(v)) for k, v in logit_bias.items()))))
    if frequency_penalty or presence_penalty:
        out.append(RepetitionPenalties(float(frequency_penalty), float(presence_penalty)))
    return out
