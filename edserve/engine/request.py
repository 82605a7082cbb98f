"""What callers hand the engine: requests and sampling parameters (what they get back is in
:mod:`edserve.engine.outputs`; the KV views, held encoder regions among them, live in
:mod:`edserve.engine.kv_views` and are importable from here too)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from numbers import Integral, Real
from typing import Any

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.kv_views import EncoderKV, FinishedKV
from edserve.engine.logits_filter import LogitsFilter
from edserve.engine.prompt_check import PromptCheck

_rid_counter = itertools.count()
# Beam search stops after round(beam_size * patience) finished candidates; beyond a few
# hundred it never stops early (decoder contexts are 448 tokens), so larger is refused.
MAX_PATIENCE = 100.0
# Alternatives a token may report (OpenAI's and vLLM's default limit for top_logprobs).
MAX_TOP_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A real number (int or float, Python or numpy), not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _token_ids(value: Any, name: str, allow_empty: bool = True) -> None:
    """ValueError unless ``value`` is a list or tuple of token ids (ints >= 0)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")
    bad = next((t for t in value if not _is_int(t) or t < 0), None)
    if bad is not None:
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {bad!r}")


def next_rid() -> str:
    return f"req-{next(_rid_counter)}"


# (field, type test, what it must be, None allowed) for SamplingParams' numeric fields
_SAMPLING_TYPES = (("temperature", _is_real, "a number", False),
                   ("top_p", _is_real, "a number", False),
                   ("seed", _is_int, "an integer", True),
                   ("max_new_tokens", _is_int, "an integer", True),
                   ("patience", _is_real, "a number", True),
                   ("length_penalty", _is_real, "a number", True),
                   ("top_logprobs", _is_int, "an integer", False))


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy (deterministic)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # per-request generator seed for temperature > 0
    max_new_tokens: int | None = None  # None: the engine's default
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-text token
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    # Beam search (temperature 0): keep the ``beam_size`` best sequences per step
    # (openai-whisper's BeamSearchDecoder); stop once ``round(beam_size * patience)`` finished
    # candidates are collected. best_of (temperature > 0): draw ``best_of`` independent samples.
    # Both share the request's encoder KV and return the best sequence by sum log-probability
    # divided by the length penalty (None: the length; else ((5 + length) / 6) ** penalty).
    beam_size: int = 1
    best_of: int = 1
    patience: float | None = None
    length_penalty: float | None = None
    # Also return, at each generated token, the ``top_logprobs`` most likely tokens with their
    # log-probabilities (as :attr:`GenerateOutput.logprobs`: after the logits filters, before
    # temperature). Plain decoding only (beam and best_of rows use the same sampler outputs).
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        """Every rule on the fields (ValueError naming the field); stop_token_ids become a
        tuple."""
        for name, is_kind, what, optional in _SAMPLING_TYPES:
            v = getattr(self, name)
            if not (is_kind(v) or optional and v is None):
                raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, "
                                 f"got {v!r}")
        _token_ids(self.stop_token_ids, "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("beam_size", "best_of"):
            n = getattr(self, name)
            if not _is_int(n) or not 1 <= n <= MAX_GROUP_ROWS:
                raise ValueError(f"{name} must be an integer in 1..{MAX_GROUP_ROWS}, got {n!r}")
        if self.beam_size > 1 and self.temperature > 0:
            raise ValueError("beam search decodes at temperature 0 (got temperature "
                             f"{self.temperature} with beam_size {self.beam_size})")
        if self.best_of > 1 and self.temperature == 0:
            raise ValueError("best_of needs sampling (temperature > 0); at temperature 0 use "
                             "beam_size")
        if self.patience is not None and (
                self.beam_size == 1 or not 0 < self.patience <= MAX_PATIENCE
                or round(self.beam_size * self.patience) < 1):
            raise ValueError(f"patience must be in (0, {MAX_PATIENCE:g}] with "
                             "round(beam_size * patience) >= 1, and needs beam_size > 1; got "
                             f"{self.patience} with beam_size {self.beam_size}")
        if self.length_penalty is not None and not 0.0 <= self.length_penalty <= 10.0:
            raise ValueError(f"length_penalty must be in [0, 10], got {self.length_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got "
                             f"{self.top_logprobs}")
        if self.top_logprobs and self.group_size > 1:
            raise ValueError("top_logprobs needs plain decoding (beam_size and best_of 1)")

    @property
    def group_size(self) -> int:
        """Rows one request decodes at once (beams or samples; 1 for plain decoding)."""
        return max(self.beam_size, self.best_of)


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-text or a stop token
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. client disconnect)
    ERROR = "error"


@dataclass
class GenerateRequest:
    """One decoder run over one encoder input.

    ``encoder_input`` is model-specific: for Whisper a log-mel ``[n_mels, 3000]`` float tensor;
    for Mllama the preprocessed image inputs (or None for text-only requests). A request that
    reuses a held encoder region (``encoder_kv``) needs none: with ``encoder_input`` None its
    encoder length and region come from the handle (the K/V it reads are the handle's, so
    nothing is encoded and no input has to travel, e.g. to an engine worker process); given
    both, the input is validated and must match the handle (ValueError otherwise). Through
    engine worker processes the input of a request with a live handle stays behind (only the
    handle is sent) and is encoded only when the handle's worker has restarted
    (:mod:`edserve.dp.handles`): a caller that may outlive a worker keeps it.
    """

    prompt_ids: list[int]
    encoder_input: Any = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Batched edits of the next-token logits, applied in order (see engine/logits_filter.py).
    logits_processors: list[LogitsFilter] = field(default_factory=list)
    # If set, the output carries softmax(logits at prompt position no_speech_pos)[no_speech_token]
    # (Whisper's no-speech probability, read at the <|startoftranscript|> position).
    no_speech_pos: int | None = None
    no_speech_token: int | None = None
    # Per prompt token, the visible encoder key range (start, end) (Mllama); decode tokens use
    # the last prompt token's range. None: every token sees the whole encoder output.
    cross_kv_ranges: list[tuple[int, int]] | None = None
    # Called on the engine thread with a :class:`FinishedKV` view just before the pool frees a
    # request that finished normally (stop or length), e.g. to read cross-attention weights for
    # word timestamps from the encoder K still in the pool. An exception fails the request.
    on_finished_kv: Callable[[FinishedKV], None] | None = None
    # keep_encoder: when the request finishes normally, its encoder region stays in the pool
    # (held by a refcount) and the output carries an :class:`EncoderKV` handle; a later request
    # over the same encoder input passes it as ``encoder_kv`` and skips the encoder (Whisper's
    # temperature fallback). The caller must hand it back: ``Engine.release_encoder(handle)``.
    keep_encoder: bool = False
    # encoder_kv: a held region (from keep_encoder / share_encoder) this request reads instead
    # of encoding; it must still be held when the request is queued and admitted. With it,
    # encoder_input may be None (encoder_len / enc_region are the handle's; see the class doc).
    encoder_kv: EncoderKV | None = None
    # share_encoder: as keep_encoder, but the hold is taken as soon as the prefill has written
    # the region and handed over in the request's FIRST delta (``TokenDelta.encoder_kv``; the
    # final one for a request not streamed), which then runs on: its siblings (a chat's n
    # choices) pass it as ``encoder_kv`` meanwhile. No handle when the request has no encoder
    # or ends before its prefill ran. The caller releases it once (Engine.release_encoder).
    share_encoder: bool = False
    # readout: what the engine computes from the finished KV for the caller, returned in
    # ``GenerateOutput.readout`` (see edserve.engine.readout; picklable, no callback).
    readout: Any = None
    # prompt_check: the prompt holds a guessed token, checked by the prefill (a request whose
    # guess is wrong ends after it; see edserve.engine.prompt_check)
    prompt_check: PromptCheck | None = None
    rid: str = field(default_factory=next_rid)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Every rule on the fields that needs no engine (run at construction and again by
        ``Engine.add_request``, which also checks what depends on the model: token ids within
        the vocabulary, encoder input, KV rows). TypeError for a logits processor that is not
        a :class:`LogitsFilter`, ValueError for any other bad field; never inside a step."""
        _token_ids(self.prompt_ids, "prompt_ids", allow_empty=False)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got "
                             f"{type(self.sampling).__name__}")
        if not isinstance(self.logits_processors, (list, tuple)):
            raise TypeError(f"logits_processors must be a list of LogitsFilter, got "
                            f"{type(self.logits_processors).__name__}")
        for f in self.logits_processors:
            if not isinstance(f, LogitsFilter):
                raise TypeError(
                    f"logits_processors holds a {type(f).__name__} ({f!r:.60}); each entry must "
                    "be an edserve.engine.logits_filter.LogitsFilter: a class with "
                    "apply(logits [n, V], ctx: FilterContext) editing the logits in place "
                    "(plain callables of the old per-request interface are not accepted)")
        self._check_positions()
        if self.on_finished_kv is not None and not callable(self.on_finished_kv):
            raise ValueError("on_finished_kv must be callable or None")
        if not isinstance(self.keep_encoder, bool):
            raise ValueError(f"keep_encoder must be a bool, got {self.keep_encoder!r}")
        if self.encoder_kv is not None and not isinstance(self.encoder_kv, EncoderKV):
            raise ValueError(f"encoder_kv must be an EncoderKV handle or None, got "
                             f"{type(self.encoder_kv).__name__}")
        if self.share_encoder is not False and (
                self.share_encoder is not True or self.keep_encoder
                or self.encoder_kv is not None or self.sampling.group_size > 1):
            raise ValueError("share_encoder must be a bool, and goes without keep_encoder, "
                             "encoder_kv and beam_size / best_of > 1")
        if self.prompt_check is not None:
            if not isinstance(self.prompt_check, PromptCheck):
                raise ValueError(f"prompt_check must be a PromptCheck or None, got "
                                 f"{type(self.prompt_check).__name__}")
            self.prompt_check.validate(self.prompt_ids, self.sampling.group_size)
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty string, got {self.rid!r}")

    def _check_positions(self) -> None:
        """no_speech_pos / no_speech_token (both or neither) and cross_kv_ranges."""
        n = len(self.prompt_ids)
        pos, tok = self.no_speech_pos, self.no_speech_token
        if (pos is None) != (tok is None):
            raise ValueError("no_speech_pos and no_speech_token go together (set both or "
                             "neither)")
        if pos is not None and (not _is_int(pos) or not 0 <= pos < n):
            raise ValueError(f"no_speech_pos must be a prompt position in 0..{n - 1}, got "
                             f"{pos!r}")
        if tok is not None and (not _is_int(tok) or tok < 0):
            raise ValueError(f"no_speech_token must be a token id, got {tok!r}")
        ranges = self.cross_kv_ranges
        if ranges is None:
            return
        if not isinstance(ranges, (list, tuple)) or len(ranges) != n:
            raise ValueError(f"cross_kv_ranges must hold one (start, end) pair per prompt token "
                             f"({n}), got {type(ranges).__name__} of "
                             f"{len(ranges) if isinstance(ranges, (list, tuple)) else '?'}")
        for r in ranges:
            if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_is_int, r))
                    and 0 <= r[0] <= r[1]):
                raise ValueError(f"cross_kv_ranges entries must be (start, end) with "
                                 f"0 <= start <= end, got {r!r}")


def check_vocab(request: GenerateRequest, vocab_size: int) -> None:
    """ValueError unless every token id the request names is below ``vocab_size`` (the
    model's embedding rows; ``Engine.add_request`` calls this)."""
    named = [("prompt_ids", request.prompt_ids),
             ("sampling.stop_token_ids", request.sampling.stop_token_ids),
             ("no_speech_token", [] if request.no_speech_token is None
              else [request.no_speech_token]),
             ("prompt_check.choices", [] if request.prompt_check is None
              else request.prompt_check.choices)]
    for name, ids in named:
        if ids and max(ids) >= vocab_size:
            raise ValueError(f"{name} holds token id {max(ids)}, outside the model's vocabulary "
                             f"of {vocab_size} ids")
