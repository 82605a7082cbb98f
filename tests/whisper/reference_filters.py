"""The per-request logit filters edserve used before batching: the test oracle for
:mod:`edserve.whisper.logits` (a line-by-line port of openai-whisper's filters).

Each processor is a callable ``(generated, logits) -> None`` that edits one request's
next-token logits ``[V]`` in place; ``generated`` holds the tokens sampled so far (prompt
excluded), so "at the first sampled position" is ``len(generated) == 0``. They run in the order
openai-whisper applies them: :class:`SuppressBlank`, :class:`SuppressTokens`,
:class:`ApplyTimestampRules`.
"""

from __future__ import annotations

import torch

from edserve.tokenizer import WhisperTokenizer

NEG_INF = float("-inf")


class SuppressBlank:
    """At the first sampled position, forbid a blank (``" "``) and end-of-text."""

    def __init__(self, tokenizer: WhisperTokenizer) -> None:
        self.ids = torch.tensor(tokenizer.encode(" ") + [tokenizer.eot])

    def __call__(self, generated: list[int], logits: torch.Tensor) -> None:
        if not generated:
            logits[self.ids.to(logits.device)] = NEG_INF


class SuppressTokens:
    """Forbid a fixed set of tokens at every position."""

    def __init__(self, ids: list[int] | tuple[int, ...]) -> None:
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> None:
        logits[self.ids.to(logits.device)] = NEG_INF


def default_suppress_tokens(tokenizer: WhisperTokenizer) -> list[int]:
    """openai-whisper's ``suppress_tokens="-1"``: non-speech symbols plus task/control tokens."""
    return list(tokenizer.non_speech_tokens()) + [
        tokenizer.transcribe, tokenizer.translate, tokenizer.sot, tokenizer.sot_prev,
        tokenizer.sot_lm, tokenizer.no_speech]


class ApplyTimestampRules:
    """Whisper's timestamp grammar (openai-whisper ``ApplyTimestampRules``).

    Timestamps come in pairs (except right before end-of-text) and never decrease; the first
    sampled token is a timestamp no later than ``max_initial_timestamp`` seconds; when the
    timestamp tokens together are likelier than any single text token, a timestamp is forced.
    """

    def __init__(self, tokenizer: WhisperTokenizer, max_initial_timestamp: float | None = 1.0,
                 time_precision: float = 0.02) -> None:
        self.eot = tokenizer.eot
        self.no_timestamps = tokenizer.no_timestamps
        self.ts_begin = tokenizer.timestamp_begin
        self.max_initial_index = None if max_initial_timestamp is None \
            else round(max_initial_timestamp / time_precision)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> None:
        tb = self.ts_begin
        logits[self.no_timestamps] = NEG_INF
        last_ts = len(generated) >= 1 and generated[-1] >= tb
        penultimate_ts = len(generated) < 2 or generated[-2] >= tb
        if last_ts:
            if penultimate_ts:  # a pair just closed: text (or end-of-text) must follow
                logits[tb:] = NEG_INF
            else:  # an open timestamp must be closed (or end the text)
                logits[:self.eot] = NEG_INF
        timestamps = [t for t in generated if t >= tb]
        if timestamps:
            # non-decreasing, and each segment has non-zero length (prevents infinite loops)
            last = timestamps[-1] if last_ts and not penultimate_ts else timestamps[-1] + 1
            logits[tb:last] = NEG_INF
        if not generated:
            logits[:tb] = NEG_INF  # the text starts with a timestamp
            if self.max_initial_index is not None:
                logits[tb + self.max_initial_index + 1:] = NEG_INF
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        ts_logprob = torch.logsumexp(logprobs[tb:], dim=-1)
        if ts_logprob > logprobs[:tb].max():
            logits[:tb] = NEG_INF
