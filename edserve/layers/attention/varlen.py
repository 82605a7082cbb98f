"""Variable-length attention on contiguous keys for the ragged strategy.

On CUDA it uses ``torch.nn.attention.varlen.varlen_attn`` (fused; present from torch 2.10);
elsewhere, or when that is missing, the torch reference.
"""

from __future__ import annotations

import torch

from edserve.layers.attention import torch_ops


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                     kv_ranges: torch.Tensor | None = None) -> torch.Tensor:
    fused = _fused()
    if fused is None or not q.is_cuda or kv_ranges is not None or q.shape[1] != k.shape[1]:
        return torch_ops.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale,
                                          kv_ranges)
    window = (-1, 0) if causal else (-1, -1)
    return fused(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, scale=scale, window_size=window)


def _fused():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # older torch
        return None
    return varlen_attn
