"""What the engine hands back: finished outputs, streamed deltas and where a request's time
went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edserve.engine.request import EncoderKV, FinishReason


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
    readout: Any = None  # the request's readout result (see GenerateRequest.readout)
    # (chosen token, its log-probability among the choices) of the request's prompt_check
    prompt_check: tuple[int, float] | None = None
    # with SamplingParams.top_logprobs = k: per generated token, the k most likely
    # (token, log-prob) pairs, best first (log-probs as ``logprobs``); else empty
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

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
    # log-probability of each of token_ids (as GenerateOutput.logprobs); empty: not known
    logprobs: list[float] = field(default_factory=list)
    # each token's alternatives (as GenerateOutput.top_logprobs); empty: none asked or known
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # a share_encoder request's handle, on its first delta only (GenerateRequest.share_encoder);
    # whoever receives the delta owns it (the clients release it when nobody reads the delta)
    encoder_kv: EncoderKV | None = None

    def encoder_handles(self) -> list[EncoderKV]:
        """Every encoder handle this delta hands to its receiver: a ``share_encoder``
        request's (``encoder_kv``) and a ``keep_encoder`` request's (``output.encoder_kv``)."""
        out = self.output.encoder_kv if self.output is not None else None
        return [h for h in (self.encoder_kv, out) if h is not None]
