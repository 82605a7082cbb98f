"""What callers hand the engine and what they get back (the engine's public request types)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from edserve.config import MAX_GROUP_ROWS

# A logits processor edits one request's next-token logits in place before sampling.
# generated: the tokens sampled so far (prompt excluded); logits: [vocab] float32.
LogitsProcessor = Callable[[list[int], torch.Tensor], None]

_rid_counter = itertools.count()


def next_rid() -> str:
    return f"req-{next(_rid_counter)}"


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

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("beam_size", "best_of"):
            n = getattr(self, name)
            if not isinstance(n, int) or not 1 <= n <= MAX_GROUP_ROWS:
                raise ValueError(f"{name} must be an integer in 1..{MAX_GROUP_ROWS}, got {n!r}")
        if self.beam_size > 1 and self.temperature > 0:
            raise ValueError("beam search decodes at temperature 0 (got temperature "
                             f"{self.temperature} with beam_size {self.beam_size})")
        if self.best_of > 1 and self.temperature == 0:
            raise ValueError("best_of needs sampling (temperature > 0); at temperature 0 use "
                             "beam_size")
        if self.patience is not None and (self.beam_size == 1 or not self.patience > 0):
            raise ValueError(f"patience must be > 0 and needs beam_size > 1, got "
                             f"{self.patience}")
        if self.length_penalty is not None and not 0.0 <= self.length_penalty <= 10.0:
            raise ValueError(f"length_penalty must be in [0, 10], got {self.length_penalty}")

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
    for Mllama the preprocessed image inputs (or None for text-only requests).
    """

    prompt_ids: list[int]
    encoder_input: Any = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
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
    encoder_kv: EncoderKV | None = None
    rid: str = field(default_factory=next_rid)


_handle_ids = itertools.count(1)


@dataclass(frozen=True, eq=False)
class EncoderKV:
    """A held encoder region: the slots of columns ``0 .. enc_region-1`` of the row that
    computed it (pages counted once more in the allocator until released)."""

    slots: torch.Tensor  # [enc_region] int64 KV slots (device)
    encoder_len: int
    enc_region: int
    id: int = field(default_factory=lambda: next(_handle_ids))


@dataclass(frozen=True)
class FinishedKV:
    """A finished request's KV, readable until the callback returns (then it is freed).

    Row layout (every encoder-KV strategy): columns ``0 .. encoder_len-1`` hold the encoder
    tokens' slots, the decoder tokens start at column ``enc_region``.
    """

    row_slots: torch.Tensor  # [row_len] int64 KV slots of the row (device)
    encoder_len: int
    enc_region: int
    kv_pool: Any  # KVPool: get_kv(layer) -> (k [slots, H, D], v [slots, H, D])
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, stop token excluded

    @property
    def encoder_slots(self) -> torch.Tensor:
        """[encoder_len] int64 slots of the encoder (cross-attention) K/V."""
        return self.row_slots[:self.encoder_len]


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went in the engine (seconds, measured on the engine's
    clock): submitted -> admitted (``queue_wait``), admitted -> first token committed
    (``prefill``: encoder + prompt), first token -> finished (``decode``)."""

    queue_wait: float
    prefill: float
    decode: float


@dataclass
class GenerateOutput:
    rid: str
    token_ids: list[int]  # generated tokens, stop token excluded
    logprobs: list[float]  # log-probability of each generated token (after processors)
    finish_reason: FinishReason
    no_speech_prob: float | None = None
    error: str | None = None
    # log-probability of the end-of-text/stop token when the request stopped on one
    stop_logprob: float | None = None
    encoder_kv: EncoderKV | None = None  # set when the request asked for keep_encoder
    timing: RequestTiming | None = None  # engine stage times (None: never admitted)

    @property
    def sum_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class TokenDelta:
    """One streamed step: the token(s) a request produced since the last delta."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    output: GenerateOutput | None = None  # set on the last delta
