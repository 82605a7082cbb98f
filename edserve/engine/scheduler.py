"""Continuous batching, as ``schedule()`` and ``update(outputs)`` around the model runner.

``schedule`` decides what runs next and prepares it on the host: admit waiting requests while
rows and pages are free (their prefill batch, encoder batched), else one decode step for every
running request; it allocates rows and slots and builds the batch. ``update`` takes a step's
sampled tokens: append, finish on a stop token or a length limit, free rows and pages. The
scheduler never calls the model, so it can be driven with made-up tokens in tests.

Admission reserves each request's worst case (encoder region + prompt + max new tokens, in
whole pages) against the allocator's free slots, so a running request can never run out of KV
mid-decode: an exhausted pool makes new requests wait, it never fails or evicts running ones.

Mixed steps (``SchedulerLimits.mixed_steps``, chunked prefill for encoder-decoder): a prefill
step also carries every running row that may take a token, ahead of the new rows, in one
forward. A running row is thus in *every* step, and between two of its tokens runs at most one
admission budget (``max_prefill_tokens``) of encoder + prompt tokens: encoder inputs are atomic
(a 30 s window is never split), so the budget bounds the windows per step (one request is
always admitted). Off, arrivals take back-to-back prefill steps and decoding waits; alternating
steps would bound the wait too, at one more forward per prefill. A mixed step runs eagerly
(CUDA graphs capture decode-only steps); if it fails, its running rows fail with it.

Overlap scheduling calls ``schedule`` for step N+1 before ``update`` for step N, so finish
checks lag one step: a request that stopped at step N has already been given step N+1, whose
token ``update`` ignores. Length limits are known without tokens, so a request at its limit is
never scheduled past it (its reservation always covers every scheduled step).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.admission import AdmissionPolicy, admit
from edserve.engine.batch_builder import Pools, build_decode, build_prefill
from edserve.engine.beam_rows import DeviceBeams, is_device_row
from edserve.engine.encoder_holds import EncoderHolds
from edserve.engine.finisher import Finisher
from edserve.engine.group_ops import (
    groups_side_by_side,
    hold_encoders,
)
from edserve.engine.group_update import RowGroupSteps
from edserve.engine.host_copy import to_device
from edserve.engine.outputs import TokenDelta
from edserve.engine.req import Req
from edserve.engine.request import FinishReason
from edserve.engine.sampler import SamplingPlan, plan_sampling, row_candidates
from edserve.engine.step import ScheduledBatch, StepOutput
from edserve.engine.token_history import HistoryEdits
from edserve.layers.forward_batch import ForwardMode

logger = logging.getLogger("edserve")


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_prefill_tokens: int  # encoder + prompt tokens admitted in one prefill step
    eos_token_id: int
    max_decoder_len: int  # model's decoder position limit
    mixed_steps: bool = False  # running rows decode in every prefill step (see schedule)
    beam_on_device: bool = False  # beam groups on fixed rows, chosen on the device
    beam_graph: bool = True  # that choice as a CUDA-graph replay on CUDA (beam_graph.py)
    beam_choice: str | None = None  # BeamBatch's choice: "triton", "ops"; None: by device
    admission: AdmissionPolicy = AdmissionPolicy()  # hold arrivals to batch their prefill
    # the same while rows are running (they wait for the step); default: no lower bound
    max_mixed_prefill_tokens: int = 1 << 62


class Scheduler(RowGroupSteps, EncoderHolds):
    def __init__(self, pools: Pools, limits: SchedulerLimits) -> None:
        self.pools = pools
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_generated_tokens = 0  # for metrics
        self._plan_key: tuple[int, ...] = ()  # decode batch the cached sampling plan is for
        self._plan: SamplingPlan | None = None
        self.finisher = Finisher(pools)
        self._edits = HistoryEdits()  # row groups' history edits for the next step
        rows = pools.req_to_token_pool.size
        self.beams = DeviceBeams(pools, rows // 2 + 1, min(MAX_GROUP_ROWS, rows),
                                 limits.max_decoder_len,
                                 None if limits.beam_graph else "eager", limits.beam_choice
                                 ) if limits.beam_on_device else None

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Req) -> None:
        total = self.pools.allocator.size
        if self._refuse_unheld(req):
            return
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
        req = next((r for r in self.running if r.rid == rid), None)
        if req is None:
            return False
        if req.group is None:
            self.running.remove(req)
            self._finish(req, FinishReason.ABORT)
        else:
            self._end_group(req.group, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (rows and slots allocated), or None when nothing can run."""
        reqs = self._below_limit(self.running)
        if reqs and any(r.group is not None for r in reqs):
            reqs = groups_side_by_side(reqs)
        new = self._admit()
        if new:
            return self._prefill(new, reqs if self.limits.mixed_steps else [])
        if not reqs:
            return None
        batch = build_decode(self.pools, reqs)
        if batch is None:  # cannot happen with reservations
            logger.warning("KV allocation failed for a decode batch; retrying later")
            return None
        for r in reqs:
            r.steps += 1
        if self.beams is not None:
            self.beams.record(reqs)
        return self._scheduled(ForwardMode.DECODE, reqs, batch, self._decode_plan(reqs))

    def _scheduled(self, mode: ForwardMode, reqs: list[Req], batch, plan: SamplingPlan,
                   prompt: torch.Tensor | None = None, new_rows: int = 0) -> ScheduledBatch:
        """The step's hand-off, carrying the row groups' pending history edits."""
        edits, self._edits = self._edits, HistoryEdits()
        groups = {r.group.id: r for r in reqs if r.group is not None}  # one row per group
        sched = ScheduledBatch(mode, reqs, batch, plan, prompt,
                               history_edits=edits if edits else None,
                               sync_update=any(not r.group.on_device for r in groups.values()))
        if self.beams is not None:
            new = [mode == ForwardMode.EXTEND and i >= len(reqs) - new_rows
                   for i in range(len(reqs))]
            # a device group's rows have taken the same number of steps
            limits = {r.group.slot: self._length_reached(r, r.steps) for r in groups.values()
                      if r.group.on_device and r.group.slot is not None}
            sched.beams = self.beams.plan(reqs, new, limits)
        return sched

    def _prefill(self, reqs: list[Req], decoding: list[Req]) -> ScheduledBatch | None:
        """A prefill step for the admitted ``reqs``; with ``decoding`` (mixed steps) the
        running rows take their next token in the same forward, ahead of the new rows."""
        batch = build_prefill(self.pools, reqs, decoding)
        if batch is None:  # cannot happen with reservations; keep requests queued if it does
            logger.warning("KV allocation failed for a prefill batch; retrying later")
            self.waiting.extendleft(reversed(reqs))
            return None
        self.running.extend(reqs)
        for r in decoding:
            r.steps += 1
        if self.beams is not None:
            self.beams.record(decoding)
        now = time.perf_counter()
        for r in reqs:
            r.steps = 1
            r.admitted_at = now
        leaders = [r for r in reqs if r.group is not None and r.request.encoder_kv is None]
        for r, hold in zip(leaders, hold_encoders(self.pools, leaders), strict=True):
            r.group.hold = hold  # the group's encoder region, for the group's lifetime
        if self.beams is not None:  # device groups' followers: own rows, from the next step
            self.running.extend(self.beams.admit([r.group for r in reqs if is_device_row(r)]))
        dev = self.pools.device
        prompt = to_device([t for r in reqs for t in r.prompt_ids], torch.int64, dev)
        rows = decoding + reqs
        first = [False] * len(decoding) + [True] * len(reqs)
        sched = self._scheduled(ForwardMode.EXTEND, rows, batch,
                                plan_sampling(rows, dev, first_step=first), prompt, len(reqs))
        sched.num_decode = len(decoding)
        return sched

    def _decode_plan(self, reqs: list[Req]) -> SamplingPlan:
        key = tuple(r.serial for r in reqs)
        if key != self._plan_key or self._plan is None:
            self._plan_key, self._plan = key, plan_sampling(reqs, self.pools.device)
        return self._plan

    def _below_limit(self, reqs: list[Req]) -> list[Req]:
        """The rows of ``reqs`` that may take another step: :meth:`_length_reached` with
        their scheduled steps, as one pass (it runs for every running row at every step)."""
        limit = self.limits.max_decoder_len
        return [r for r in reqs
                if r.steps < r.max_new_tokens and len(r.prompt_ids) + r.steps < limit]

    def _length_reached(self, req: Req, tokens: int) -> bool:
        """True once ``tokens`` generated tokens are the request's last allowed one
        (max_new_tokens, or the model's decoder positions). ``schedule`` asks it with the
        steps scheduled so far, ``update`` with the tokens committed: the same rule."""
        return tokens >= req.max_new_tokens \
            or len(req.prompt_ids) + tokens >= self.limits.max_decoder_len

    def _admit(self) -> list[Req]:
        return admit(self.waiting, self.running, self.pools, self.limits)

    # ---- update -----------------------------------------------------------------------
    def fail(self, sched: ScheduledBatch, error: str) -> None:
        """The runner could not run ``sched``: its requests fail (a mixed step's running rows
        too: they were advanced for it), the engine goes on."""
        groups = {}
        for req in sched.reqs:
            if req.finish_reason is None and req.group is None:
                self.running.remove(req)
                self._finish(req, FinishReason.ERROR, error)
            elif req.group is not None:
                groups[req.group.id] = req.group
        for g in groups.values():  # every row of the group, not only this batch's
            self._end_group(g, FinishReason.ERROR, error)

    def update(self, sched: ScheduledBatch, output: StepOutput) -> None:
        """Commit one step's tokens (waits for them: the step's one device->host sync)."""
        tokens, logprobs, no_speech = output.fetch()
        if sched.mode == ForwardMode.EXTEND:  # the new rows' first tokens are here (a mixed
            now = time.perf_counter()  # step's decode rows had theirs already)
            for req in sched.reqs[sched.num_decode:]:
                req.first_token_at = now
        if sched.sync_update:
            self._update_groups(sched, output, tokens, logprobs, no_speech)
        if sched.beams is not None:
            self._update_device_groups(sched, output, no_speech)
        checks = output.fetch_checks()
        cp = sched.sampling.candidates  # rows asking for top_logprobs: their alternatives
        tops = row_candidates(cp, output.fetch_candidates(), cp.top_rows) \
            if cp is not None and cp.top_rows else {}
        ending: list[tuple[Req, FinishReason, str | None, list[int]]] = []  # finished together
        for i, (req, tok, lp, ns) in enumerate(zip(sched.reqs, tokens, logprobs, no_speech,
                                                   strict=True)):
            if req.finish_reason is not None or req.group is not None:
                continue  # finished or aborted while this step was in flight; groups: above
            if sched.is_new(i):
                req.no_speech_prob, req.prompt_check = ns, checks[i]
                if req.request.share_encoder:  # the region is written: the caller's hold
                    self.finisher.share(req)
                if req.check_rejected:  # a wrong guess: ends here (prompt_check.py)
                    ending.append((req, FinishReason.STOP, None, []))
                    continue
            sp = req.request.sampling
            if (tok == self.limits.eos_token_id and not sp.ignore_eos) \
                    or tok in sp.stop_token_ids:
                req.stop_logprob = lp
                ending.append((req, FinishReason.STOP, None, []))
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            top = tops.get(i)
            if top is not None:
                req.top_logprobs.append(top)
            self.num_generated_tokens += 1
            if self._length_reached(req, len(req.output_ids)):
                ending.append((req, FinishReason.LENGTH, None, [tok]))
            elif req.stream and req.on_delta is not None:
                req.on_delta(TokenDelta(req.rid, [tok], logprobs=[lp],
                                        top_logprobs=[] if top is None else [top],
                                        encoder_kv=req.take_share()))
        if ending:  # off the running list in one pass, their rows freed in one release
            gone = {id(e[0]) for e in ending}
            self.running[:] = [r for r in self.running if id(r) not in gone]
            self.finisher.finish_many(ending)

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None,
                last: list[int] | None = None) -> None:
        self.finisher.finish(req, reason, error, last or [])
