"""The engine: loads the model, sizes the KV cache, and drives the scheduler.

Thread model: :meth:`Engine.step` runs on one thread (the caller's, or the background loop of
:class:`~edserve.engine.async_engine.AsyncEngine`). Other threads submit and abort through a
thread-safe inbox that the stepping thread drains at the start of each step.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import torch

from edserve.config import EngineConfig
from edserve.engine.batch_builder import Pools
from edserve.engine.cpu_modes import apply_threads
from edserve.engine.cuda_graph import DecodeGraphRunner
from edserve.engine.groups import make_group, reserved_slots
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, GenerateOutput, GenerateRequest, TokenDelta
from edserve.engine.runner import ModelRunner
from edserve.engine.sampler import make_generator
from edserve.engine.scheduler import Scheduler, SchedulerLimits
from edserve.engine.step import ScheduledBatch, StepOutput
from edserve.engine.token_history import TokenHistory
from edserve.layers.attention import create_backend, resolve_page_size
from edserve.mem_cache import (
    KVCacheConfig,
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    plan_kv_cache,
)
from edserve.models.fp8 import apply_encoder_dtype, check_fp8, kv_cache_dtype
from edserve.models.quantize import check_supported, quantize_model
from edserve.models.registry import build_model
from edserve.models.weights import load_checkpoint

logger = logging.getLogger("edserve")

_EXTRA_COLS = 4  # slack columns per req_to_token row
_DEFAULT_MAX_CONTEXT = 8192  # decoder positions when --context-length is not given
_DEFAULT_PREFILL_TOKENS = {False: 65536, True: 262144}  # by "on CUDA"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 on CPU (measured fastest exact mode there; int8 is
    opt-in, ``--quantization int8``: see :mod:`edserve.engine.cpu_modes`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)} or auto, got {name!r}")
    return _DTYPES[name]


class Engine:
    """``Engine(EngineConfig(...))`` or ``Engine(page_size="16", encoder_kv="aligned")``."""

    def __init__(self, config: EngineConfig | None = None, *, checkpoint: Any = None,
                 **overrides: Any) -> None:
        """``checkpoint``: an already loaded :class:`~edserve.models.weights.Checkpoint`
        (benchmarks build random-weight models in memory); default: load ``config.model``."""
        config = (config or EngineConfig()).replace(**overrides)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_supported(config.quantization, self.device, self.dtype)  # before loading
        self.threads = apply_threads(config.threads, self.device)
        ops = config.attention_backend
        if ops == "auto":
            ops = "triton" if self.device.type == "cuda" else "torch"
        restrict = tuple(int(s) for s in config.restrict_page_sizes.split(",")) \
            if config.restrict_page_sizes else None
        self.page_size = resolve_page_size(config.page_size, config.encoder_kv, ops, restrict)
        check_fp8(config.encoder_dtype, config.kv_cache_dtype, config.quantization, self.device,
                  ops, self.dtype)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if checkpoint is None:
            checkpoint = load_checkpoint(config.model)
        self.model, self.tokenizer = build_model(checkpoint, self.dtype, self.device)
        del checkpoint
        self.model = quantize_model(self.model, config.quantization)
        self.model = apply_encoder_dtype(self.model, config.encoder_dtype)
        backend = create_backend(config.encoder_kv, self.page_size, ops)
        self.pools = self._make_pools(backend)
        eos = self.model.config.eos_token_id
        limits = SchedulerLimits(
            max_running_requests=self.pools.req_to_token_pool.size,
            max_prefill_tokens=max(config.max_prefill_tokens or _DEFAULT_PREFILL_TOKENS[
                self.device.type == "cuda"], self.max_row_len),
            eos_token_id=eos,
            max_decoder_len=self.max_decoder_len,
            mixed_steps=config.mixed_steps)
        graphs = None
        if self._use_cuda_graph(ops):
            max_bs = config.cuda_graph_max_bs or limits.max_running_requests
            graphs = DecodeGraphRunner(self.model, self.pools,
                                       min(max_bs, limits.max_running_requests))
        history = TokenHistory(self.pools.req_to_token_pool.size, self.max_decoder_len,
                               self.device)
        self.runner = ModelRunner(self.model, self.device, history, graphs)
        self.scheduler = Scheduler(self.pools, limits)
        self.overlap = config.overlap_schedule == "on" or (
            config.overlap_schedule == "auto" and self.device.type == "cuda")
        self._in_flight: tuple[ScheduledBatch, StepOutput] | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def _use_cuda_graph(self, ops: str) -> bool:
        """``--cuda-graph`` unset: on where supported (CUDA, triton, aligned/flat)."""
        wanted = self.config.cuda_graph
        if wanted is None:
            return self.device.type == "cuda" and ops == "triton" \
                and self.config.encoder_kv != "ragged"
        return wanted

    # ---- sizing -----------------------------------------------------------------------
    @property
    def max_decoder_len(self) -> int:
        limit = self.model.max_decoder_len
        return min(limit, self.config.context_length or _DEFAULT_MAX_CONTEXT)

    @property
    def max_row_len(self) -> int:
        """Longest row: the model's largest encoder region + its decoder positions."""
        return self.pools.backend.encoder_region(self.model.max_encoder_len) \
            + self.max_decoder_len

    def _make_pools(self, backend) -> Pools:
        cfg = self.config
        m = self.model
        context_len = backend.encoder_region(m.max_encoder_len) + self.max_decoder_len
        # Admission reserves whole pages; a row may round up to one extra page.
        context_len = -(-context_len // self.page_size) * self.page_size
        memory_bytes, used = cfg.kv_cache_bytes, 0
        max_total = cfg.max_total_tokens
        if self.device.type == "cuda" and memory_bytes is None:
            memory_bytes = torch.cuda.get_device_properties(self.device).total_memory
            used = torch.cuda.memory_allocated(self.device)
        elif memory_bytes is None and max_total is None:
            # Room for max_running_requests full rows (+ the table's slack columns).
            max_total = cfg.max_running_requests * (context_len + _EXTRA_COLS + self.page_size)
        plan = plan_kv_cache(KVCacheConfig(
            num_layers=m.num_kv_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            dtype=self.kv_dtype, page_size=self.page_size,
            max_running_requests=cfg.max_running_requests, context_len=context_len,
            mem_fraction_static=cfg.mem_fraction_static, max_total_tokens=max_total,
            memory_bytes=memory_bytes, used_bytes=used, extra_cols=_EXTRA_COLS))
        kv_pool = KVPool(plan.num_slots, self.page_size, m.num_kv_layers, m.num_kv_heads,
                         m.head_dim, self.kv_dtype, self.device)
        rtp = ReqToTokenPool(plan.num_rows, plan.max_context_len, self.device)
        debug = cfg.debug_checks
        allocator = PagedTokenToKVPoolAllocator(plan.num_slots, self.page_size, self.device,
                                                debug) if self.page_size > 1 \
            else TokenToKVPoolAllocator(plan.num_slots, self.device, debug)
        return Pools(rtp, allocator, kv_pool, backend, self.device)

    # ---- requests ---------------------------------------------------------------------
    def make_req(self, request: GenerateRequest,
                 on_delta: Callable[[TokenDelta], None] | None = None,
                 stream: bool = True) -> Req:
        """Validate a request and wrap it for the scheduler (raises ValueError when invalid)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("prompt_ids must not be empty")
        if n >= self.max_decoder_len:
            raise ValueError(f"prompt of {n} tokens leaves no room in the decoder's "
                             f"{self.max_decoder_len} positions (see --context-length)")
        enc_len = self.model.encoder_len(request.encoder_input)  # validates the input
        enc_region = self.pools.backend.encoder_region(enc_len)
        max_new = request.sampling.max_new_tokens or self.config.max_new_tokens
        max_new = min(max_new, self.max_decoder_len - n)
        sp = request.sampling
        if sp.group_size > self.pools.req_to_token_pool.size:
            raise ValueError(f"beam_size/best_of {sp.group_size} needs as many KV rows, but the "
                             f"engine runs at most {self.pools.req_to_token_pool.size} "
                             "(raise --max-running-requests)")
        held = request.encoder_kv
        if held is not None and (held.encoder_len != enc_len or held.enc_region != enc_region):
            raise ValueError(f"encoder_kv holds {held.encoder_len} encoder tokens but the "
                             f"request's encoder input has {enc_len}")
        reserved = reserved_slots(enc_region, n + max_new, self.page_size, sp.group_size,
                                  reuse=held is not None)
        req = Req(request, enc_len, enc_region, max_new, reserved, on_delta, stream,
                  generator=make_generator(sp.seed, self.device),
                  encoder_input=None if held is not None else request.encoder_input)
        req.group = make_group(req, self.model.config.eos_token_id, self.device)
        return req

    def release_encoder(self, handle: EncoderKV) -> None:
        """Thread-safe: hand back a ``keep_encoder`` handle (its pages free once unused)."""
        self._inbox.put(("release", handle))

    def add_request(self, request: GenerateRequest,
                    on_delta: Callable[[TokenDelta], None] | None = None,
                    stream: bool = True) -> str:
        """Thread-safe submit; ``on_delta`` is called on the stepping thread, for every new
        token when ``stream``, else only with the final output."""
        self._inbox.put(("add", self.make_req(request, on_delta, stream)))
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
        self._drain_inbox()
        previous, self._in_flight = self._in_flight, None
        sched = self.scheduler.schedule()
        if sched is not None:
            try:
                output = self.runner.run(sched)
            except Exception as exc:  # a failing batch fails its requests, not the engine
                logger.exception("forward failed")
                self.scheduler.fail(sched, f"{type(exc).__name__}: {exc}")
            else:
                if self.overlap and not sched.sync_update:
                    self._in_flight = (sched, output)
                else:  # row groups decide on the host before the next step is scheduled
                    if previous is not None:
                        self.scheduler.update(*previous)
                        previous = None
                    self.scheduler.update(sched, output)
        if previous is not None:
            self.scheduler.update(*previous)

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
        holders = [rtp.req_to_token[r.req_pool_idx, :r.row_len].long() for r in sched.running]
        holders += [h.slots for h in sched.held_regions()]
        pools.allocator.check_integrity(holders=holders)
        rtp.check_integrity(len(sched.running))

    def transcribe(self, inputs: list[Any], **kwargs: Any) -> list[Any]:
        """Transcribe audio files/arrays (Whisper); see :func:`edserve.whisper.transcribe`."""
        from edserve.whisper.transcribe import transcribe

        return transcribe(self, inputs, **kwargs)
