"""openai-whisper's logit filters, batched: each acts on ``[n, V]`` logits with tensor ops.

They run in the order openai-whisper applies them: :class:`SuppressBlank`,
:class:`SuppressTokens`, :class:`ApplyTimestampRules`. Each is a frozen dataclass of its
settings, so equal settings compare equal and the sampler filters every request that shares
them in one call (see :mod:`edserve.engine.logits_filter`). ``ctx.history`` holds the tokens
sampled so far (prompt excluded), so "the first sampled position" is ``ctx.lengths == 0``.
No filter syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edserve.engine.logits_filter import FilterContext, LogitsFilter, filter_cache, vocab_ids
from edserve.tokenizer import WhisperTokenizer

NEG_INF = float("-inf")


_INTERNED: dict[tuple, Any] = {}
_MAX_INTERNED = 256  # distinct id sets kept (a model has a handful; bounds odd callers)


def interned(cls: type, ids: tuple[int, ...]) -> Any:
    """One shared instance per (filter class, ids): every task of a model reuses it and its
    device masks (built and uploaded once, not once per task)."""
    key = (cls, ids)
    found = _INTERNED.get(key)
    if found is None:
        found = cls(ids)
        if len(_INTERNED) < _MAX_INTERNED:
            found = _INTERNED.setdefault(key, found)
    return found


@dataclass(frozen=True)
class SuppressTokens(LogitsFilter):
    """Forbid a fixed set of tokens at every position."""

    capturable = True

    ids: tuple[int, ...]
    _masks: dict = filter_cache()

    @classmethod
    def of(cls, ids: list[int] | tuple[int, ...]) -> SuppressTokens:
        return interned(cls, tuple(sorted(set(ids))))

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        # only the suppressed columns are written (~90 of tiny.en's 51864)
        logits.index_fill_(1, vocab_ids(self.ids, logits.shape[-1], logits.device, self._masks),
                           NEG_INF)


@dataclass(frozen=True)
class SuppressBlank(LogitsFilter):
    """At the first sampled position, forbid a blank (``" "``) and end-of-text."""

    capturable = True

    ids: tuple[int, ...]
    _masks: dict = filter_cache()

    @classmethod
    def of(cls, tokenizer: WhisperTokenizer) -> SuppressBlank:
        return interned(cls, (*tokenizer.blank_tokens(), tokenizer.eot))

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        cols = vocab_ids(self.ids, logits.shape[-1], logits.device, self._masks)  # [K]
        first = (ctx.lengths == 0)[:, None]  # [n, 1]
        logits.index_copy_(1, cols, logits.index_select(1, cols).masked_fill_(first, NEG_INF))


def default_suppress_tokens(tokenizer: WhisperTokenizer) -> list[int]:
    """openai-whisper's ``suppress_tokens="-1"``: non-speech symbols plus task/control tokens."""
    return list(tokenizer.non_speech_tokens()) + [
        tokenizer.transcribe, tokenizer.translate, tokenizer.sot, tokenizer.sot_prev,
        tokenizer.sot_lm, tokenizer.no_speech]


@dataclass(frozen=True)
class ApplyTimestampRules(LogitsFilter):
    """Whisper's timestamp grammar (openai-whisper ``ApplyTimestampRules``), over rows.

    Timestamps come in pairs (except right before end-of-text) and never decrease; the first
    sampled token is a timestamp no later than ``max_initial_index`` steps of 20 ms; when the
    timestamp tokens together are likelier than any single text token, a timestamp is forced.
    """

    capturable = True

    eot: int
    no_timestamps: int
    ts_begin: int
    max_initial_index: int | None = 50

    @classmethod
    def of(cls, tokenizer: WhisperTokenizer, max_initial_timestamp: float | None = 1.0,
           time_precision: float = 0.02) -> ApplyTimestampRules:
        index = None if max_initial_timestamp is None \
            else round(max_initial_timestamp / time_precision)
        return cls(tokenizer.eot, tokenizer.no_timestamps, tokenizer.timestamp_begin, index)

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        """On CUDA one Triton program a row (:mod:`edserve.kernels.timestamp_rules`: ~20
        small kernels fewer a step), else :meth:`apply_ops`; the same result."""
        if logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1 \
                and ctx.history.dtype == ctx.lengths.dtype == torch.int64 \
                and ctx.history.stride(1) == 1:
            from edserve.kernels.timestamp_rules import apply_timestamp_rules  # CUDA only

            apply_timestamp_rules(logits, ctx.history, ctx.lengths, self.eot,
                                  self.no_timestamps, self.ts_begin, self.max_initial_index)
            return
        self.apply_ops(logits, ctx)

    def apply_ops(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        """The rules as tensor ops (any device; the reference of the CUDA kernel,
        :mod:`edserve.kernels.timestamp_rules`)."""
        # Each row's allowed tokens are [a, b) U [c, V) minus <|notimestamps|>, with [R] bounds
        # from the row's history; one mask pass over [R, V] applies every rule at once.
        tb, n, V = self.ts_begin, ctx.lengths, logits.shape[-1]
        last_ts = ctx.last(1) >= tb  # [R] (False when nothing was sampled)
        penult_ts = (n < 2) | (ctx.last(2) >= tb)  # [R]
        pos = torch.arange(ctx.history.shape[1], device=logits.device)[None, :]  # [1, C]
        is_ts = (ctx.history >= tb) & (pos < n[:, None])  # [R, C]
        where = torch.where(is_ts, pos, -1).amax(dim=1)  # [R] index of the last timestamp
        last = ctx.history.gather(1, where.clamp(min=0)[:, None])[:, 0]  # [R] its token
        pair_open = last_ts & ~penult_ts  # the open timestamp must be closed (or end)
        pair_closed = last_ts & penult_ts  # text (or end) must follow
        first = n == 0  # the text starts with a timestamp <= max_initial_timestamp
        # Timestamps never decrease, and a segment has non-zero length: none below the last
        # one sampled (below it + 1 unless a pair is open).
        lowest_ts = torch.where(where >= 0, torch.where(pair_open, last, last + 1), tb)
        top = V if self.max_initial_index is None else tb + self.max_initial_index + 1
        a = torch.where(first, tb, torch.where(pair_open, self.eot, 0))  # [R]
        b = torch.where(first, top, tb)  # [R]
        c = torch.where(first | pair_closed, V, lowest_ts)  # [R] (c == V: no second range)
        col = torch.arange(V, device=logits.device)[None, :]  # [1, V]
        allowed = ((col >= a[:, None]) & (col < b[:, None])) \
            | (col >= c[:, None])  # [R, V]
        logits.masked_fill_(~allowed | (col == self.no_timestamps), NEG_INF)
        # Timestamps together likelier than any single text token: force one. (The compared
        # log-softmax terms share their normaliser, so compare the raw logits.)
        ts_mass = torch.logsumexp(logits[:, tb:].float(), dim=-1)  # [R]
        best_text = logits[:, :tb].amax(dim=-1)  # [R]
        logits[:, :tb].masked_fill_((ts_mass > best_text)[:, None], NEG_INF)
