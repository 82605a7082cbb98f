"""The engine: drives the scheduler over a model and its KV pools (built elsewhere: see
:mod:`edserve.runtime`).

Thread model: :meth:`Engine.step` runs on one thread (the caller's, or the background loop of
:class:`~edserve.engine.async_engine.AsyncEngine`). Other threads submit and abort through a
thread-safe inbox that the stepping thread drains at the start of each step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from edserve.engine import readout
from edserve.engine.admission import AdmissionPolicy
from edserve.engine.beam_rows import is_device_row
from edserve.engine.draw import make_generator
from edserve.engine.groups import make_group, reserved_slots
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.parts import EngineParts
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, GenerateRequest, check_vocab
from edserve.engine.runner import ModelRunner
from edserve.engine.scheduler import Scheduler, SchedulerLimits
from edserve.engine.step import ScheduledBatch, StepOutput
from edserve.engine.step_clock import StepClock
from edserve.engine.step_stats import StepCounters, step_kind
from edserve.engine.token_history import TokenHistory
from edserve.layers.forward_batch import ForwardMode

logger = logging.getLogger("edserve")


class Engine:
    """Drives one model over its KV pools. Built by :func:`edserve.runtime.build_engine`
    (or ``edserve.build_engine``), which hands over the loaded model, the sized pools and the
    captured graphs; the engine loads nothing itself."""

    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config  # resolved: max_running_requests is the concrete limit
        self.device, self.dtype, self.threads = parts.device, parts.dtype, parts.threads
        self.page_size = parts.page_size
        self.model, self.tokenizer, self.pools = parts.model, parts.tokenizer, parts.pools
        self.max_decoder_len = parts.max_decoder_len
        limits = SchedulerLimits(
            max_running_requests=self.pools.req_to_token_pool.size,
            max_prefill_tokens=parts.max_prefill_tokens,
            max_mixed_prefill_tokens=parts.max_mixed_prefill_tokens,
            eos_token_id=self.model.config.eos_token_id,
            max_decoder_len=self.max_decoder_len,
            mixed_steps=self.config.mixed_steps,
            beam_on_device=self.config.beam_on_device,
            beam_graph=self.config.cuda_graph is not False,  # --no-cuda-graph: eager launches
            beam_choice=None if self.config.beam_choice == "auto" else self.config.beam_choice,
            admission=AdmissionPolicy(self.config.admission_wait_ms / 1000,
                                      self.config.admission_batch))
        history = TokenHistory(self.pools.req_to_token_pool.size, self.max_decoder_len,
                               self.device)
        self.runner = ModelRunner(self.model, self.device, history, parts.graphs)
        self.scheduler = Scheduler(self.pools, limits)
        self.overlap = self.config.overlap_schedule == "on" or (
            self.config.overlap_schedule == "auto" and self.device.type == "cuda")
        self._in_flight: tuple[ScheduledBatch, StepOutput] | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.step_counters = StepCounters()  # per kind of step (read between steps)
        self.clock = StepClock(self.device)  # the steps' device times (CUDA)
        self._warm_threads: set[int] = set()  # threads that ran warm_up

    def warm_up(self) -> None:
        """``--encoder-warmup-max-bs``: the encoder once at batch sizes 1..N on the calling
        thread, the first time this thread asks (``step`` does; the server's loop does before
        serving). cuDNN's attention plans and cuBLAS's handles are per thread: measured on an
        H200, a warm-up on the building thread left the server's engine thread paying ~0.6 s
        of plan builds while serving. A failure is logged; serving goes on."""
        ident = threading.get_ident()
        if ident in self._warm_threads:
            return
        self._warm_threads.add(ident)
        n = self.config.encoder_warmup_max_bs or 0
        if n and hasattr(self.model, "warm_encoder"):
            try:
                self.model.warm_encoder(n)
            except Exception:
                logger.exception("encoder warm-up failed")

    @property
    def is_mllama(self) -> bool:
        """The model is Llama-3.2-Vision (chat), not Whisper (the one place this is decided)."""
        return getattr(self.model, "model_type", None) == "mllama"

    # ---- requests ---------------------------------------------------------------------
    def make_req(self, request: GenerateRequest,
                 on_delta: Callable[[TokenDelta], None] | None = None,
                 stream: bool = True) -> Req:
        """Validate a request and wrap it for the scheduler (raises ValueError when invalid,
        TypeError for a logits processor that is not a LogitsFilter): the request's own rules
        (:meth:`GenerateRequest.check`, again: fields may be set after construction), then
        what depends on this engine's model and pools.

        The request's encoder extent (tokens, region columns): from ``encoder_input``
        (validated by the model); a request reusing a held region (``encoder_kv``) may leave
        ``encoder_input`` None and takes it from the handle (:meth:`_encoder_extent`)."""
        request.check()
        n = len(request.prompt_ids)
        check_vocab(request, self.model.input_vocab_size)
        if n >= self.max_decoder_len:
            raise ValueError(f"prompt of {n} tokens leaves no room in the decoder's "
                             f"{self.max_decoder_len} positions (see --context-length)")
        enc_len, enc_region = self._encoder_extent(request)
        if request.cross_kv_ranges is not None \
                and max(end for _, end in request.cross_kv_ranges) > enc_len:
            raise ValueError(f"cross_kv_ranges reach past the request's {enc_len} encoder "
                             "tokens")
        max_new = request.sampling.max_new_tokens or self.config.max_new_tokens
        max_new = min(max_new, self.max_decoder_len - n)
        sp = request.sampling
        if sp.group_size > self.pools.req_to_token_pool.size:
            raise ValueError(f"beam_size/best_of {sp.group_size} needs as many KV rows, but the "
                             f"engine runs at most {self.pools.req_to_token_pool.size} "
                             "(raise --max-running-requests)")
        for f in request.logits_processors:  # a grammar compiles against our tokenizer
            f.bind(self.tokenizer, sp.group_size)
        held = request.encoder_kv
        reserved = reserved_slots(enc_region, n + max_new, self.page_size, sp.group_size,
                                  reuse=held is not None)
        req = Req(request, enc_len, enc_region, max_new, reserved, on_delta, stream,
                  generator=make_generator(sp.seed, self.device),
                  encoder_input=None if held is not None else request.encoder_input)
        req.group = make_group(req, self.model.config.eos_token_id, self.device,
                               self.config.beam_on_device)
        return req

    def _encoder_extent(self, request: GenerateRequest) -> tuple[int, int]:
        """(encoder tokens, encoder-region columns) of a request (ValueError when they do not
        hold up). Without a handle: from ``encoder_input`` (the model validates it; None is
        a text-only Mllama request). With ``encoder_kv`` and no input: the handle's, which
        must be a region of this engine's layout. With both: the input's, which must agree
        with the handle."""
        held, backend = request.encoder_kv, self.pools.backend
        if held is not None and request.encoder_input is None:
            if held.enc_region != backend.encoder_region(held.encoder_len):
                raise ValueError(f"encoder_kv holds {held.encoder_len} encoder tokens in "
                                 f"{held.enc_region} columns; this engine lays them out in "
                                 f"{backend.encoder_region(held.encoder_len)}")
            return held.encoder_len, held.enc_region
        enc_len = self.model.encoder_len(request.encoder_input)  # validates the input
        enc_region = backend.encoder_region(enc_len)
        if held is not None and (held.encoder_len != enc_len or held.enc_region != enc_region):
            raise ValueError(f"encoder_kv holds {held.encoder_len} encoder tokens but the "
                             f"request's encoder input has {enc_len}")
        return enc_len, enc_region

    def release_encoder(self, handle: EncoderKV) -> None:
        """Thread-safe: hand back a ``keep_encoder`` handle (its pages free once unused)."""
        self._inbox.put(("release", handle))

    def add_request(self, request: GenerateRequest,
                    on_delta: Callable[[TokenDelta], None] | None = None,
                    stream: bool = True) -> str:
        """Thread-safe submit; ``on_delta`` is called on the stepping thread, for every new
        token when ``stream``, else only with the final output. A request's ``readout``
        (:mod:`edserve.engine.readout`) runs here and comes back in its output."""
        request, on_delta = readout.attach(request, self.model, on_delta)
        req = self.make_req(request, on_delta, stream)
        stage = getattr(self.model, "stage_encoder_input", None)  # Whisper: pinned log-mels
        if stage is not None and req.encoder_input is not None:
            req.encoder_input = stage(req.encoder_input)
        self._inbox.put(("add", req))
        return request.rid

    def abort(self, rid: str) -> None:
        """Thread-safe: cancel a request; its row and KV are freed at the next step."""
        self._inbox.put(("abort", rid))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(payload)
            elif kind == "release":
                self.scheduler.release_encoder(payload)
            else:
                self.scheduler.abort(payload)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty() \
            or self._in_flight is not None

    def step(self) -> None:
        """schedule -> run -> update. With overlap, step N's update (which waits for its
        tokens) runs after step N+1 has been scheduled and launched, so the host prepares the
        next batch while the device computes this one."""
        self.warm_up()  # once per stepping thread
        started = time.perf_counter()
        self._drain_inbox()
        previous, self._in_flight = self._in_flight, None
        sched = self.scheduler.schedule()
        if sched is not None:
            marks = self.clock.begin(in_flight=previous is not None)
            try:
                output = self.runner.run(sched)
            except Exception as exc:  # a failing batch fails its requests, not the engine
                logger.exception("forward failed")
                self.scheduler.fail(sched, f"{type(exc).__name__}: {exc}")
            else:
                output.marks = marks
                self.clock.launched(output.end_event)
                if self.overlap and not sched.sync_update:
                    self._in_flight = (sched, output)
                else:  # row groups decide on the host before the next step is scheduled
                    if previous is not None:
                        self._update(*previous)
                        previous = None
                    self._update(sched, output)
        if previous is not None:
            self._update(*previous)
        if sched is not None:
            self.step_counters.record(_kind(sched), len(sched.reqs), _new_rows(sched),
                                      time.perf_counter() - started)

    def _update(self, sched: ScheduledBatch, output: StepOutput) -> None:
        """The scheduler takes a step's results; its device times go to the step counters."""
        self.scheduler.update(sched, output)
        device, gap = self.clock.read(output.marks, output.end_event)
        self.step_counters.record_device(_kind(sched), output.waited, device, gap)

    def generate(self, requests: list[GenerateRequest],
                 on_finish: Callable[[GenerateOutput], None] | None = None
                 ) -> list[GenerateOutput]:
        """Run requests to completion together (continuous batching) and return in order."""
        outputs: dict[str, GenerateOutput] = {}

        def collect(delta: TokenDelta) -> None:
            if delta.finished:
                outputs[delta.rid] = delta.output
                if on_finish is not None:
                    on_finish(delta.output)

        for r in requests:
            self.add_request(r, collect, stream=False)
        while self.has_work():
            self.step()
        return [outputs[r.rid] for r in requests]

    # ---- health -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every KV slot is free or owned by a running request; every row free or held."""
        sched, pools = self.scheduler, self.pools
        rtp = pools.req_to_token_pool
        holders = [sched.beams.holder(r) if is_device_row(r) else
                   rtp.req_to_token[r.req_pool_idx, :r.row_len].long() for r in sched.running]
        holders += [h.slots for h in sched.held_regions()]
        pools.allocator.check_integrity(holders=holders)
        rtp.check_integrity(len(sched.running))
        followers = getattr(self.model, "check_followers", None)  # tensor-parallel ranks
        if followers is not None:
            followers()


def _new_rows(sched: ScheduledBatch) -> int:
    """Rows a step admitted (its prefilling rows)."""
    return len(sched.reqs) - sched.num_decode if sched.mode == ForwardMode.EXTEND else 0


def _kind(sched: ScheduledBatch) -> str:
    """``decode``, ``prefill`` or ``mixed`` (:func:`~edserve.engine.step_stats.step_kind`)."""
    return step_kind(len(sched.reqs), _new_rows(sched))
