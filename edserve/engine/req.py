"""The scheduler's per-request state (internal; callers see GenerateRequest/GenerateOutput)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edserve.engine.outputs import GenerateOutput, RequestTiming, TokenDelta
from edserve.engine.request import EncoderKV, FinishReason, GenerateRequest
from edserve.engine.row_group import RowGroup

_serials = itertools.count()


@dataclass(eq=False)
class Req:
    request: GenerateRequest
    encoder_len: int  # encoder tokens (0 = no encoder)
    enc_region: int  # columns reserved for the encoder (strategy-dependent)
    max_new_tokens: int
    reserved_slots: int  # KV slots promised at admission (whole pages): decode never runs dry
    on_delta: Callable[[TokenDelta], None] | None = None
    stream: bool = True  # False: on_delta hears only the final delta (no per-token calls)
    req_pool_idx: int | None = None  # row in req_to_token (set by ReqToTokenPool.alloc)
    kv_len: int = 0  # decoder tokens whose K/V are in the pool
    steps: int = 0  # forward steps scheduled (each samples one token; some may be in flight)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per output token, its top_logprobs alternatives (only when the request asks for them)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_logprob: float | None = None
    no_speech_prob: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    encoder_input: Any = None  # dropped once the encoder has run
    group: RowGroup | None = None  # beam search / best_of rows of one request
    cow_pending: bool = False  # a fork: copy a shared partial last page before writing
    kept_encoder: EncoderKV | None = None  # the keep_encoder handle, once finished
    # share_encoder: the hold taken after the prefill (its pages are shared from then on),
    # and that handle until a delta carries it to the caller
    shared_encoder: bool = False
    share_out: EncoderKV | None = None
    # the prefill's (token, log-prob) for request.prompt_check (see check_rejected)
    prompt_check: tuple[int, float] | None = None
    serial: int = field(default_factory=lambda: next(_serials))  # unique per Req object
    # perf_counter() stamps for the output's RequestTiming: made (submitted), admitted
    # (prefill scheduled), first token committed
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None

    def fork(self, generator: torch.Generator | None) -> Req:
        """A new row of this row's group continuing this row's sequence (its KV and token
        history come from the scheduler, :class:`~edserve.engine.group_ops.RowOps`). Every
        field is named: the child takes the request, its limits, its encoder region and its
        step count; it starts with no row, no own reservation (the group's leader holds it),
        no callbacks, no outputs, ``generator`` as its random stream, and a copy-on-write
        pending on its first write."""
        if self.group is None:
            raise ValueError(f"request {self.rid}: only a row of a row group can fork")
        return Req(request=self.request, encoder_len=self.encoder_len,
                   enc_region=self.enc_region, max_new_tokens=self.max_new_tokens,
                   reserved_slots=0, on_delta=None, stream=False, req_pool_idx=None,
                   kv_len=self.kv_len, steps=self.steps, output_ids=[], logprobs=[],
                   top_logprobs=[], stop_logprob=None, no_speech_prob=None, finish_reason=None,
                   error=None,
                   generator=generator, encoder_input=None, group=self.group,
                   cow_pending=True, kept_encoder=None, shared_encoder=False,
                   share_out=None, prompt_check=None)

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def row_len(self) -> int:
        """Columns of the row in use: encoder region + cached decoder tokens."""
        return self.enc_region + self.kv_len

    @property
    def check_rejected(self) -> bool:
        """The prefill chose another token than the request's guess (``prompt_check``)."""
        check = self.request.prompt_check
        return self.prompt_check is not None and check is not None \
            and self.prompt_check[0] != check.guess(self.prompt_ids)

    @property
    def shares_pages(self) -> bool:
        """The row may hold pages other holders count too (its free drops references)."""
        r = self.request
        # (a keep_encoder row shares nothing until it finishes: Finisher.finish then frees it
        # around the hold it takes, without a host read)
        return self.group is not None or r.encoder_kv is not None or self.shared_encoder

    def take_share(self) -> EncoderKV | None:
        """The share_encoder handle for the delta being made (once; None afterwards)."""
        handle, self.share_out = self.share_out, None
        return handle

    def output(self) -> GenerateOutput:
        assert self.finish_reason is not None
        return GenerateOutput(self.rid, list(self.output_ids), list(self.logprobs),
                              self.finish_reason, self.no_speech_prob, self.error,
                              self.stop_logprob, self.kept_encoder, self._timing(),
                              prompt_check=self.prompt_check,
                              top_logprobs=list(self.top_logprobs))

    def _timing(self) -> RequestTiming | None:
        if self.admitted_at is None:
            return None
        now = time.perf_counter()
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestTiming(self.admitted_at - self.submitted_at, first - self.admitted_at,
                             now - first)
