"""Size and build the KV pools, and resolve the running-request limit.

    context_len  = ceil_page(encoder_region(max_encoder_len) + max_decoder_len)
    CUDA         : KV pool from device memory (--mem-fraction-static), rows as below
    CPU          : room for max_running_requests full rows (unless --kv-cache-bytes /
                   --max-total-tokens say otherwise)
    running (auto, CUDA) = min(KV slots // worst-case slots per request, graph cap)
    running (auto, CPU)  = CPU_RUNNING_DEFAULT

A request's worst case is one full row: its encoder region plus every decoder position
(``max_context_len`` columns of ``req_to_token``), so ``running`` requests always fit in the pool
whatever their lengths.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from edserve.config import CPU_RUNNING_DEFAULT, GRAPH_MAX_BS_DEFAULT, EngineConfig
from edserve.engine.batch_builder import Pools
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.mem_cache import (
    KVCacheConfig,
    KVCachePlan,
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    plan_kv_cache,
)
from edserve.runtime.settings import RuntimeSettings

logger = logging.getLogger("edserve")

EXTRA_COLS = 4  # slack columns per req_to_token row


@dataclass(frozen=True)
class PoolSizing:
    """The pools and why they have their size (logged at start-up)."""

    pools: Pools
    max_running_requests: int
    reason: str  # how the running limit was chosen


def graph_cap(config: EngineConfig) -> int:
    """Largest decode batch the CUDA graphs capture (and the auto running limit's cap)."""
    return config.cuda_graph_max_bs or GRAPH_MAX_BS_DEFAULT


def _plan(config: EngineConfig, s: RuntimeSettings, model, context_len: int,
          running: int) -> KVCachePlan:
    memory_bytes, used = config.kv_cache_bytes, 0
    max_total = config.max_total_tokens
    if s.on_cuda and memory_bytes is None:
        memory_bytes = torch.cuda.get_device_properties(s.device).total_memory
        used = torch.cuda.memory_allocated(s.device)
    elif memory_bytes is None and max_total is None:
        # Room for `running` full rows (+ the table's slack columns).
        max_total = running * (context_len + EXTRA_COLS + s.page_size)
    return plan_kv_cache(KVCacheConfig(
        num_layers=model.num_kv_layers, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=s.kv_dtype, page_size=s.page_size,
        max_running_requests=running, context_len=context_len,
        mem_fraction_static=config.mem_fraction_static, max_total_tokens=max_total,
        memory_bytes=memory_bytes, used_bytes=used, extra_cols=EXTRA_COLS))


def _auto_running(config: EngineConfig, s: RuntimeSettings, model, context_len: int
                  ) -> tuple[KVCachePlan, str]:
    if not s.on_cuda:
        plan = _plan(config, s, model, context_len, CPU_RUNNING_DEFAULT)
        return plan, f"auto on CPU: {CPU_RUNNING_DEFAULT} (the CPU default)"
    cap = graph_cap(config)
    return auto_running(_plan(config, s, model, context_len, cap), cap)


def auto_running(plan: KVCachePlan, cap: int) -> tuple[KVCachePlan, str]:
    """The plan with as many rows as full-length requests fit in its slots, at most ``cap``;
    and the reason, for the start-up log."""
    fit = max(1, plan.num_slots // plan.max_context_len)
    rows = min(fit, cap)
    reason = (f"auto on CUDA: {rows} = min(KV pool {plan.num_slots} slots // "
              f"{plan.max_context_len} slots per request at its worst case = {fit}, "
              f"CUDA-graph cap {cap})")
    return dataclasses.replace(plan, num_rows=rows), reason


def build_pools(config: EngineConfig, s: RuntimeSettings, model,
                backend: EncoderDecoderBackend, max_row: int) -> PoolSizing:
    """The request table, KV pool and allocator for ``model`` under ``config``; ``max_row``:
    the longest row (the largest encoder region + every decoder position)."""
    # Admission reserves whole pages; a row may round up to one extra page.
    context_len = -(-max_row // s.page_size) * s.page_size
    if config.max_running_requests is None:
        plan, reason = _auto_running(config, s, model, context_len)
    else:
        plan = _plan(config, s, model, context_len, config.max_running_requests)
        reason = f"--max-running-requests {config.max_running_requests}"
        if plan.num_rows < config.max_running_requests:
            reason += f", lowered to {plan.num_rows} by the KV pool"
    kv_pool = KVPool(plan.num_slots, s.page_size, model.num_kv_layers, model.num_kv_heads,
                     model.head_dim, s.kv_dtype, s.device, write_kernel=s.ops == "triton")
    rtp = ReqToTokenPool(plan.num_rows, plan.max_context_len, s.device)
    debug = config.debug_checks
    allocator = PagedTokenToKVPoolAllocator(plan.num_slots, s.page_size, s.device, debug) \
        if s.page_size > 1 else TokenToKVPoolAllocator(plan.num_slots, s.device, debug)
    logger.info("max running requests: %s", reason)
    return PoolSizing(Pools(rtp, allocator, kv_pool, backend, s.device), plan.num_rows, reason)
