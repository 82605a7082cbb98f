"""Continuous batching, as ``schedule()`` and ``update(outputs)`` around the model runner.

``schedule`` decides what runs next and prepares it on the host: admit waiting requests while
rows and pages are free (their prefill batch, encoder batched), else one decode step for every
running request; it allocates rows and slots and builds the batch. ``update`` takes a step's
sampled tokens: append, finish on a stop token or a length limit, free rows and pages. The
scheduler never calls the model, so it can be driven with made-up tokens in tests.

Admission reserves each request's worst case (encoder region + prompt + max new tokens, in
whole pages) against the allocator's free slots, so a running request can never run out of KV
mid-decode: an exhausted pool makes new requests wait, it never fails or evicts running ones.

Overlap scheduling calls ``schedule`` for step N+1 before ``update`` for step N, so finish
checks lag one step: a request that stopped at step N has already been given step N+1, whose
token ``update`` ignores. Length limits are known without tokens, so a request at its limit is
never scheduled past it (its reservation always covers every scheduled step).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from edserve.engine.batch_builder import Pools, build_decode, build_prefill, release
from edserve.engine.forward_batch import ForwardMode
from edserve.engine.host_copy import to_device
from edserve.engine.req import Req
from edserve.engine.request import FinishedKV, FinishReason, TokenDelta
from edserve.engine.sampler import SamplingPlan, plan_sampling
from edserve.engine.step import ScheduledBatch, StepOutput

logger = logging.getLogger("edserve")


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_prefill_tokens: int  # encoder + prompt tokens admitted in one prefill step
    eos_token_id: int
    max_decoder_len: int  # model's decoder position limit


class Scheduler:
    def __init__(self, pools: Pools, limits: SchedulerLimits) -> None:
        self.pools = pools
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_generated_tokens = 0  # for metrics
        self._plan_key: tuple[int, ...] = ()  # decode batch the cached sampling plan is for
        self._plan: SamplingPlan | None = None

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

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (rows and slots allocated), or None when nothing can run."""
        new = self._admit()
        if new:
            return self._prefill(new)
        reqs = [r for r in self.running if not self._length_reached(r, r.steps)]
        if not reqs:
            return None
        batch = build_decode(self.pools, reqs)
        if batch is None:  # cannot happen with reservations
            logger.warning("KV allocation failed for a decode batch; retrying later")
            return None
        for r in reqs:
            r.steps += 1
        return ScheduledBatch(ForwardMode.DECODE, reqs, batch, self._decode_plan(reqs))

    def _prefill(self, reqs: list[Req]) -> ScheduledBatch | None:
        batch = build_prefill(self.pools, reqs)
        if batch is None:  # cannot happen with reservations; keep requests queued if it does
            logger.warning("KV allocation failed for a prefill batch; retrying later")
            self.waiting.extendleft(reversed(reqs))
            return None
        self.running.extend(reqs)
        for r in reqs:
            r.steps = 1
        dev = self.pools.device
        prompt = to_device([t for r in reqs for t in r.prompt_ids], torch.int64, dev)
        return ScheduledBatch(ForwardMode.EXTEND, reqs, batch, plan_sampling(reqs, dev), prompt)

    def _decode_plan(self, reqs: list[Req]) -> SamplingPlan:
        key = tuple(r.serial for r in reqs)
        if key != self._plan_key or self._plan is None:
            self._plan_key, self._plan = key, plan_sampling(reqs, self.pools.device)
        return self._plan

    def _length_reached(self, req: Req, tokens: int) -> bool:
        """True once ``tokens`` generated tokens are the request's last allowed one
        (max_new_tokens, or the model's decoder positions). ``schedule`` asks it with the
        steps scheduled so far, ``update`` with the tokens committed: the same rule."""
        return tokens >= req.max_new_tokens \
            or len(req.prompt_ids) + tokens >= self.limits.max_decoder_len

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

    # ---- update -----------------------------------------------------------------------
    def fail(self, sched: ScheduledBatch, error: str) -> None:
        """The runner could not run ``sched``: its requests fail, the engine goes on."""
        for req in sched.reqs:
            if req.finish_reason is None:
                self.running.remove(req)
                self._finish(req, FinishReason.ERROR, error)

    def update(self, sched: ScheduledBatch, output: StepOutput) -> None:
        """Commit one step's tokens (waits for them: the step's one device->host sync)."""
        tokens, logprobs, no_speech = output.fetch()
        for req, tok, lp, ns in zip(sched.reqs, tokens, logprobs, no_speech, strict=True):
            if req.finish_reason is not None:
                continue  # finished or aborted while this step was in flight
            if sched.mode == ForwardMode.EXTEND:
                req.no_speech_prob = ns
            sp = req.request.sampling
            if (tok == self.limits.eos_token_id and not sp.ignore_eos) \
                    or tok in sp.stop_token_ids:
                req.stop_logprob = lp
                self._finish_running(req, FinishReason.STOP, [])
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            self.num_generated_tokens += 1
            if self._length_reached(req, len(req.output_ids)):
                self._finish_running(req, FinishReason.LENGTH, [tok])
            elif req.stream and req.on_delta is not None:
                req.on_delta(TokenDelta(req.rid, [tok]))

    def _finish_running(self, req: Req, reason: FinishReason, last: list[int]) -> None:
        self.running.remove(req)
        self._finish(req, reason, None, last)

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None,
                last: list[int] | None = None) -> None:
        hook = req.request.on_finished_kv
        if hook is not None and reason in (FinishReason.STOP, FinishReason.LENGTH) \
                and req.req_pool_idx is not None:
            try:
                hook(self._finished_kv(req))
            except Exception as exc:  # the request fails, the engine goes on
                logger.exception("on_finished_kv failed")
                reason, error = FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
        release(self.pools, [req])
        req.finish_reason = reason
        req.error = error
        req.encoder_input = None
        if req.on_delta is not None:
            req.on_delta(TokenDelta(req.rid, last or [], finished=True, output=req.output()))

    def _finished_kv(self, req: Req) -> FinishedKV:
        rtp = self.pools.req_to_token_pool
        return FinishedKV(rtp.req_to_token[req.req_pool_idx, :req.row_len].long(),
                          req.encoder_len, req.enc_region, self.pools.kv_pool,
                          list(req.prompt_ids), list(req.output_ids))


def _ceil(n: int, page_size: int) -> int:
    return (n + page_size - 1) // page_size * page_size
