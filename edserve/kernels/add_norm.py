"""Triton residual add + LayerNorm: one pass over the rows where torch runs two (or three).

``add_layer_norm(x, delta, weight, bias, eps, gate)`` returns ``(new_x, normed)`` with

  * ``new_x = x + delta``, or ``x + gate * delta`` with ``gate`` a 1-element tensor (already
    tanh'ed: Mllama's global layers pass ``gate_attn.tanh()``); ``gate * delta`` is rounded to
    x's dtype first, then the sum is rounded to x's dtype: the two roundings of torch's
    ``x + gate * delta`` (each op computes in fp32 and rounds its output);
  * ``normed = LayerNorm(new_x) * weight + bias`` over the last dimension, computed in fp32
    from the ROUNDED ``new_x`` (as ``nn.LayerNorm`` reads the stored tensor): mean, biased
    variance (two-pass, from registers), ``rstd = 1 / sqrt(var + eps)``, then ``(new_x - mean)
    * rstd * weight + bias`` in fp32, rounded once to x's dtype (as torch's CUDA kernel).

With ``delta=None`` it is a plain LayerNorm (``new_x`` is ``x`` itself): :func:`layer_norm`.
On the GPU ``new_x`` equals torch's bit for bit; ``normed`` differs from torch's only by fp32
sum order and sqrt vs rsqrt (a rounding of x's dtype, here and there). The CPU interpreter
truncates fp32 -> bf16 casts (the GPU rounds to nearest even): an ulp off in bf16.
``new_x`` and ``normed`` are fresh contiguous tensors (x is never written). A program holds
whole rows (``d <= MAX_NORM_DIM``, any ``d``: masked lanes): one row when ``d >= 1024``, else
``1024 // next_pow2(d)`` rows.
No host syncs and no data-dependent shapes: safe under CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.norm_act import MAX_NORM_DIM, _rows

ROW_ELEMENTS = 1024  # narrow rows are packed into a program up to this many elements


@triton.jit
def _add_layer_norm_kernel(X, Delta, Gate, W, B, NewX, Out, stride_x, stride_d, stride_n,
                           stride_o, n_rows, n_cols, eps, HAS_DELTA: tl.constexpr,
                           HAS_GATE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]  # [ROWS, BLOCK]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(Delta + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
        if HAS_GATE:
            g = tl.load(Gate).to(tl.float32)
            d = (g * d.to(tl.float32)).to(X.dtype.element_ty)  # torch rounds gate * delta
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)  # ... and the sum
        tl.store(NewX + rows[:, None] * stride_n + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)  # the rounded new_x, as LayerNorm reads it
    mean = tl.sum(xf, 1) / n_cols  # [ROWS]
    diff = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, 1) / n_cols + eps)  # [ROWS]
    y = diff * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rows[:, None] * stride_o + cols[None, :], y.to(Out.dtype.element_ty),
             mask=mask)


def _check_param(p: torch.Tensor | None, name: str, x: torch.Tensor) -> None:
    N = x.shape[-1]
    if p is not None and (p.shape != (N,) or not p.is_floating_point() or p.device != x.device
                          or not p.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous float [{N}] on {x.device}, got "
                         f"{tuple(p.shape)} {p.dtype} {p.device}")


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float,
                   gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta ``[..., d]`` (one shape and dtype; rows evenly strided, last dim contiguous);
    weight, bias ``[d]`` or None (any float dtype: read as fp32, as torch's mixed-dtype
    LayerNorm); gate: None or a 1-element tensor in x's dtype (used as given: pass it
    tanh'ed). -> ``(new_x, normed)``, both ``[..., d]`` contiguous in x's dtype (module doc);
    ``new_x`` is ``x`` when ``delta`` is None."""
    N = x.shape[-1] if x.dim() else 0
    if not 1 <= N <= MAX_NORM_DIM:
        raise ValueError(f"add_layer_norm: last dimension {N} not in [1, {MAX_NORM_DIM}]")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype
                              or delta.device != x.device):
        raise ValueError(f"delta must match x ({tuple(x.shape)} {x.dtype} {x.device}), got "
                         f"{tuple(delta.shape)} {delta.dtype} {delta.device}")
    if gate is not None and (delta is None or gate.numel() != 1 or gate.dtype != x.dtype
                             or gate.device != x.device):
        raise ValueError(f"gate must be a 1-element {x.dtype} tensor on {x.device} with a "
                         f"delta, got {tuple(gate.shape)} {gate.dtype} {gate.device}")
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    x2 = _rows(x, "x")  # [R, d]
    d2 = x2 if delta is None else _rows(delta, "delta")  # [R, d]
    new_x = x if delta is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n2 = x2 if delta is None else new_x.view(-1, N)  # [R, d]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, N)  # [R, d]
    R = x2.shape[0]
    if R:
        block = triton.next_power_of_2(N)
        rows = max(1, ROW_ELEMENTS // block)  # rows per program: one for d >= 1024
        _add_layer_norm_kernel[(triton.cdiv(R, rows),)](
            x2, d2, x2 if gate is None else gate, x2 if weight is None else weight,
            x2 if bias is None else bias, n2, o2, x2.stride(0), d2.stride(0), n2.stride(0),
            o2.stride(0), R, N, float(eps), HAS_DELTA=delta is not None,
            HAS_GATE=gate is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            ROWS=rows, BLOCK=block, num_warps=min(16, max(1, rows * block // 256)))
    return new_x, out


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """Plain LayerNorm of x ``[..., d]`` (``add_layer_norm`` without a delta)."""
    return add_layer_norm(x, None, weight, bias, eps)[1]
