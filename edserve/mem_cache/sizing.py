"""Sizing: turn a memory budget and model dims into slot, row and column counts.

    budget     = memory_bytes * mem_fraction_static - used_bytes     (bytes for the KV pool)
    num_slots  = floor_page(budget // bytes_per_token - page_size)   (minus the padding page)
    num_slots  = min(num_slots, floor_page(max_total_tokens))        (if given)
    max_context_len = ceil_page(context_len + extra_cols)            (columns of req_to_token)
    num_rows   = max(1, min(max_running_requests, num_slots // 2))

With ``memory_bytes=None`` the slot count comes from ``max_total_tokens`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.mem_cache.errors import PoolTooSmallError

_GB = 1024**3


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def ceil_align(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return cdiv(n, multiple) * multiple


def floor_align(n: int, multiple: int) -> int:
    """Largest multiple of ``multiple`` that is <= ``n``."""
    return (n // multiple) * multiple


@dataclass(frozen=True)
class KVCacheConfig:
    """Inputs of ``plan_kv_cache``: model dims, page size and the memory budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    max_running_requests: int
    context_len: int  # longest request (encoder + decoder tokens) a row must hold
    extra_cols: int = 4  # slack columns beyond context_len
    mem_fraction_static: float = 0.8  # share of memory_bytes for weights + KV pool
    max_total_tokens: int | None = None  # cap on KV slots
    memory_bytes: int | None = None  # total device memory, or a byte budget
    used_bytes: int = 0  # already used (weights, activations) out of the static share

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_running_requests < 1:
            raise ValueError(
                f"KVCacheConfig.max_running_requests must be >= 1, got {self.max_running_requests}"
            )
        if self.context_len < 1 or self.extra_cols < 0:
            raise ValueError(
                f"KVCacheConfig: context_len must be >= 1 and extra_cols >= 0, got "
                f"{self.context_len} and {self.extra_cols}"
            )
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"KVCacheConfig.mem_fraction_static must be in (0, 1], got "
                f"{self.mem_fraction_static}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.memory_bytes is None and self.max_total_tokens is None:
            raise ValueError("KVCacheConfig needs memory_bytes or max_total_tokens (both None)")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class KVCachePlan:
    """Outputs of ``plan_kv_cache``; build the pools from these."""

    num_slots: int  # usable KV slots, a page multiple (the pool adds one padding page)
    num_rows: int  # rows of req_to_token besides the padding row
    max_context_len: int  # columns of req_to_token, a page multiple
    bytes_per_token: int
    total_bytes: int  # K + V bytes of the pool, padding page included


def plan_kv_cache(cfg: KVCacheConfig) -> KVCachePlan:
    """Size the KV pool and request table; raise ``PoolTooSmallError`` if no request fits."""
    ps = cfg.page_size
    bpt = cfg.bytes_per_token
    max_context_len = ceil_align(cfg.context_len + cfg.extra_cols, ps)

    if cfg.memory_bytes is not None:
        budget = int(cfg.memory_bytes * cfg.mem_fraction_static) - cfg.used_bytes
        if budget <= 0:
            raise PoolTooSmallError(
                f"no memory left for the KV cache: {cfg.memory_bytes / _GB:.2f} GB x "
                f"mem_fraction_static {cfg.mem_fraction_static} - used "
                f"{cfg.used_bytes / _GB:.2f} GB = {budget / _GB:.2f} GB"
            )
        num_slots = max(0, floor_align(budget // bpt - ps, ps))
        source = (
            f"budget {budget / _GB:.3f} GB ({budget} B) / {bpt} B per token, "
            f"floored to pages of {ps}"
        )
        if cfg.max_total_tokens is not None:
            num_slots = min(num_slots, floor_align(cfg.max_total_tokens, ps))
            source += f", capped by max_total_tokens={cfg.max_total_tokens}"
    else:
        assert cfg.max_total_tokens is not None  # checked in KVCacheConfig
        num_slots = floor_align(cfg.max_total_tokens, ps)
        source = f"max_total_tokens={cfg.max_total_tokens} floored to pages of {ps}"

    if num_slots < max_context_len:
        raise PoolTooSmallError(
            f"KV pool holds {num_slots} tokens ({source}), fewer than one request needs: "
            f"max_context_len={max_context_len} (context_len {cfg.context_len} + extra_cols "
            f"{cfg.extra_cols}, rounded up to page size {ps}). Raise mem_fraction_static or "
            f"max_total_tokens, or lower the context length."
        )
    num_rows = max(1, min(cfg.max_running_requests, num_slots // 2))
    return KVCachePlan(
        num_slots=num_slots,
        num_rows=num_rows,
        max_context_len=max_context_len,
        bytes_per_token=bpt,
        total_bytes=(num_slots + ps) * bpt,
    )
