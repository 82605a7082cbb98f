"""Triton rotary position embedding (rotate-half layout): one kernel per tensor where torch
runs five (neg, cat, two muls, add).

``rope(x, cos, sin)`` = ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``,
rounded to x's dtype after each product and after the sum, as torch computes it, so the result
is bitwise the torch op's. No host syncs: safe under CUDA graph capture.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, Cos, Sin, Out, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                 stride_oh, n_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    half = HEAD_DIM // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)
    dmask = d < HEAD_DIM
    mask = (h < n_heads)[:, None] & dmask[None, :]
    row = X + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xr = tl.load(row + partner[None, :], mask=mask, other=0.0)
    c = tl.load(Cos + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    a = (x.to(tl.float32) * c[None, :]).to(dt)
    rot = tl.where(first[None, :], -xr.to(tl.float32), xr.to(tl.float32))
    b = (rot * s[None, :]).to(dt)
    out = a.to(tl.float32) + b.to(tl.float32)
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(dt), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, H, D]`` (last dim contiguous; a view of a fused GEMM output is fine); cos, sin
    ``[T, 1, D]`` or ``[T, D]`` in x's dtype -> a new ``[T, H, D]`` tensor."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if x.dim() != 3 or x.shape[-1] % 2 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        raise ValueError(f"x must be [T, H, D] with an even D, contiguous in D; got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    T, H, D = x.shape
    cos2, sin2 = cos.reshape(cos.shape[0], cos.shape[-1]), sin.reshape(sin.shape[0], sin.shape[-1])
    for name, t in (("cos", cos2), ("sin", sin2)):
        if t.shape != (T, D) or t.dtype != x.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, 1, D] = [{T}, 1, {D}] {x.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H:
        block_h = min(16, triton.next_power_of_2(H))
        _rope_kernel[(T, triton.cdiv(H, block_h))](
            x, cos2, sin2, out, x.stride(0), x.stride(1), cos2.stride(0), sin2.stride(0),
            out.stride(0), out.stride(1), H, HEAD_DIM=D, BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out
