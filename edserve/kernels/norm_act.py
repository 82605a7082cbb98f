"""Triton RMSNorm and SiLU-and-multiply: one kernel each where torch runs five or two.

Both round where the torch reference (:mod:`edserve.layers.elementwise`) rounds, so results
match it to the last bit except for fp32 rsqrt/exp differences:
  * ``rms_norm(x, w, eps)`` = ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
    over the last dimension (the Llama/Mllama RMSNorm);
  * ``silu_mul(g, u)`` = ``silu(g) * u`` (silu rounded to the input dtype first, as
    ``F.silu(g) * u``).

No host syncs and no data-dependent shapes: safe under CUDA graph capture.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_NORM_DIM = 16384  # one program holds a row


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * inv).to(X.dtype.element_ty)  # the reference rounds to x's dtype here
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)  # silu, rounded as F.silu's output
    out = s.to(tl.float32) * u.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as ``[rows, cols]`` without a copy when its rows are evenly strided."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        raise ValueError(f"{name} must be at least 1-D and contiguous in its last dimension")
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x ``[..., N]``; weight ``[N]`` (x's dtype) -> ``[..., N]`` in x's dtype."""
    N = x.shape[-1]
    if weight.shape != (N,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{N}] {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    if N > MAX_NORM_DIM:
        raise ValueError(f"rms_norm: dimension {N} > {MAX_NORM_DIM}")
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), N,
                                         float(eps), BLOCK=block,
                                         num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u ``[T, I]`` (views of one ``[T, 2I]`` GEMM output are fine) -> ``silu(g) * u``."""
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device or g.dim() != 2:
        raise ValueError(f"g and u must be [T, I] of one dtype and device, got "
                         f"{tuple(g.shape)} {g.dtype}, {tuple(u.shape)} {u.dtype}")
    _rows(g, "g")
    _rows(u, "u")
    T, n = g.shape
    out = torch.empty((T, n), dtype=g.dtype, device=g.device)
    if T and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(T, triton.cdiv(n, block))](g, u, out, g.stride(0), u.stride(0),
                                                     out.stride(0), n, BLOCK=block,
                                                     num_warps=4)
    return out
