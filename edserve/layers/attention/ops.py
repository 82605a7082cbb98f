"""Attention op sets: the kernels a strategy calls, chosen by name (a registry, not ``if`` chains).

An op set provides ``paged``, ``flat`` and ``varlen`` with the signatures documented in
:mod:`edserve.layers.attention.torch_ops`, plus the page sizes its paged kernel supports, and
optionally ``grouped_cross`` (decode cross-attention reading a row group's encoder K/V once,
:mod:`edserve.kernels.grouped_cross_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionOps:
    name: str
    paged: Callable
    flat: Callable
    varlen: Callable
    paged_page_sizes: tuple[int, ...] | None  # None: any page size
    supports_kv_ranges: bool  # per-query key ranges (Mllama cross-attention masks)
    grouped_cross: Callable | None = None  # None: rows sharing an encoder read it per run


def _torch_ops() -> AttentionOps:
    from edserve.layers.attention import torch_ops

    return AttentionOps("torch", torch_ops.paged_attention, torch_ops.flat_attention,
                        torch_ops.varlen_attention, None, True)


def _triton_ops() -> AttentionOps:
    from edserve.kernels import flat_attention, paged_attention
    from edserve.kernels.grouped_cross_attention import grouped_cross_attention
    from edserve.layers.attention.varlen import varlen_attention

    return AttentionOps("triton", paged_attention.paged_attention, flat_attention.flat_attention,
                        varlen_attention, tuple(paged_attention.SUPPORTED_PAGE_SIZES), True,
                        grouped_cross_attention)


OPS_REGISTRY: dict[str, Callable[[], AttentionOps]] = {"torch": _torch_ops, "triton": _triton_ops}


def get_ops(name: str) -> AttentionOps:
    if name not in OPS_REGISTRY:
        raise ValueError(f"unknown attention ops {name!r}; choose from {sorted(OPS_REGISTRY)}")
    return OPS_REGISTRY[name]()
