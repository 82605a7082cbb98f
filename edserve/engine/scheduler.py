"""Continuous batching: admit while rows and pages are free, prefill new requests (encoder
batched), then decode everything running; finished or aborted requests free their row and
pages at once.

Admission reserves each request's worst case (encoder region + prompt + max new tokens, in
whole pages) against the allocator's free slots, so a running request can never run out of KV
mid-decode: an exhausted pool makes new requests wait, it never fails or evicts running ones.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from edserve.engine.batch_builder import Pools, build_decode, build_prefill, release
from edserve.engine.forward_batch import ForwardMode
from edserve.engine.req import Req
from edserve.engine.request import FinishReason, TokenDelta
from edserve.engine.runner import ModelRunner

logger = logging.getLogger("edserve")


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_prefill_tokens: int  # encoder + prompt tokens admitted in one prefill step
    eos_token_id: int
    max_decoder_len: int  # model's decoder position limit


class Scheduler:
    def __init__(self, pools: Pools, runner: ModelRunner, limits: SchedulerLimits) -> None:
        self.pools = pools
        self.runner = runner
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_generated_tokens = 0  # for metrics

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Req) -> None:
        total = self.pools.allocator.size
        if req.reserved_slots > total:
            self._finish(req, FinishReason.ERROR,
                         f"request needs {req.reserved_slots} KV slots but the pool holds only "
                         f"{total}; raise --max-total-tokens or lower max_new_tokens")
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, FinishReason.ABORT)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one engine step -------------------------------------------------------------
    def step(self) -> None:
        new = self._admit()
        if new:
            self._run(new, ForwardMode.EXTEND)
        elif self.running:
            self._run(list(self.running), ForwardMode.DECODE)

    def _outstanding_reservations(self) -> int:
        ps = self.pools.kv_pool.page_size
        return sum(r.reserved_slots - _ceil(r.row_len, ps) for r in self.running)

    def _admit(self) -> list[Req]:
        if not self.waiting:
            return []
        budget = self.pools.allocator.available_size() - self._outstanding_reservations()
        rows = self.pools.req_to_token_pool.available_size()
        room = self.limits.max_running_requests - len(self.running)
        tokens = 0
        admitted: list[Req] = []
        while self.waiting and len(admitted) < min(rows, room):
            req = self.waiting[0]
            need = req.enc_region + len(req.prompt_ids)
            if req.reserved_slots > budget or (admitted and
                                               tokens + need > self.limits.max_prefill_tokens):
                break  # back-pressure: wait for running requests to free KV
            admitted.append(self.waiting.popleft())
            budget -= req.reserved_slots
            tokens += need
        return admitted

    def _run(self, reqs: list[Req], mode: ForwardMode) -> None:
        build = build_prefill if mode == ForwardMode.EXTEND else build_decode
        batch = build(self.pools, reqs)
        if batch is None:  # cannot happen with reservations; keep requests queued if it does
            logger.warning("KV allocation failed for a %s batch; retrying later", mode.name)
            if mode == ForwardMode.EXTEND:
                self.waiting.extendleft(reversed(reqs))
            return
        if mode == ForwardMode.EXTEND:
            self.running.extend(reqs)
        try:
            tokens, logprobs = self.runner.run(batch, reqs)
        except Exception as exc:  # a failing batch fails its requests, not the engine
            logger.exception("forward failed")
            for req in reqs:
                self.running.remove(req)
                self._finish(req, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            return
        self._commit(reqs, tokens, logprobs)

    def _commit(self, reqs: list[Req], tokens: list[int], logprobs: list[float]) -> None:
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            sp = req.request.sampling
            stop = (tok == self.limits.eos_token_id and not sp.ignore_eos) \
                or tok in sp.stop_token_ids
            if stop:
                req.stop_logprob = lp
                self._finish_running(req, FinishReason.STOP, [])
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            self.num_generated_tokens += 1
            at_limit = len(req.output_ids) >= req.max_new_tokens \
                or req.kv_len + 1 >= self.limits.max_decoder_len
            if at_limit:
                self._finish_running(req, FinishReason.LENGTH, [tok])
            elif req.stream and req.on_delta is not None:
                req.on_delta(TokenDelta(req.rid, [tok]))

    def _finish_running(self, req: Req, reason: FinishReason, last: list[int]) -> None:
        self.running.remove(req)
        self._finish(req, reason, None, last)

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None,
                last: list[int] | None = None) -> None:
        release(self.pools, [req])
        req.finish_reason = reason
        req.error = error
        req.encoder_input = None
        if req.on_delta is not None:
            req.on_delta(TokenDelta(req.rid, last or [], finished=True, output=req.output()))


def _ceil(n: int, page_size: int) -> int:
    return (n + page_size - 1) // page_size * page_size


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen
