"""The float64 oracle of the dense (mask-free) attention kernels' tests, and their inputs."""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def reference(q, k, v, scale):
    """float64 ``softmax(q k^T scale) v``: [B, H, Lq, D] -> [B, Lq, H, D]."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.double()).transpose(1, 2)


def fused_qkv(B, L, H, D, dtype, seed=0):
    """q, k, v ``[B, H, L, D]``: views of one fused ``[B, L, 3, H, D]`` tensor on :data:`DEV`,
    as the encoders' qkv projections lay them out."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, L, 3, H, D, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    return qkv.permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, D] views, strides of the fused layout
