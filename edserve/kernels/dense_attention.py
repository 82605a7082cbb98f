"""Triton bidirectional attention over dense q/k/v at any head dim, without padding it.

For the Mllama vision tower (16 heads of 80): SDPA's fastest backend on the H200 (cuDNN) runs
head dim 80 in about the time of 128 (zero-padded, `benchmarks/attn_headdim.py`). Here the
head dim is cut into two power-of-two chunks (80 = 64 + 16): a score tile is
``q_a @ k_a^T + q_b @ k_b^T`` and the output is kept as two accumulators ``p @ v_a`` and
``p @ v_b``, so the dots do exactly the work of ``D`` columns. Measured (RESULTS.md, wave 24):
as fast as cuDNN on 4-tile images (2.24 ms), within ~5 % either way on the other shapes; the
tower gains ~3 % from writing the output in place (no copy after SDPA).

Contract: q ``[B, H, Lq, D]``, k and v ``[B, H, Lk, D]`` (any strides, unit stride on D), no
mask (every query sees all ``Lk`` keys); the result is written into ``out [B, Lq, H, D]`` (any
strides, unit stride on D), which may be a view into a larger buffer (the vision plan writes
its two query ranges straight into the layer's output). Scores, running max and sum are fp32
in log2 units (``exp2``); ``p`` is cast to the value dtype for the second dot, as flash
attention does. ``Lk == 0`` gives zeros. No host syncs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edserve.kernels.common import LOG2E, MAX_HEAD_DIM

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_block(k_base, v_base, j, jm, d, d_ok, s_kn, s_vn, MASK_J: tl.constexpr,
                MASK_D: tl.constexpr, UPCAST: tl.constexpr):
    """k^T ``[D_*, N]`` and v ``[N, D_*]`` of keys ``j`` at columns ``d`` (masks only where
    the constexpr flags say a row or column can be out of range)."""
    kp = k_base + j[None, :] * s_kn + d[:, None]
    vp = v_base + j[:, None] * s_vn + d[None, :]
    if MASK_J and MASK_D:
        kt = tl.load(kp, mask=jm[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vp, mask=jm[:, None] & d_ok[None, :], other=0.0)
    elif MASK_J:
        kt = tl.load(kp, mask=jm[None, :], other=0.0)
        v = tl.load(vp, mask=jm[:, None], other=0.0)
    elif MASK_D:
        kt = tl.load(kp, mask=d_ok[:, None], other=0.0)
        v = tl.load(vp, mask=d_ok[None, :], other=0.0)
    else:
        kt = tl.load(kp)
        v = tl.load(vp)
    if UPCAST:  # the CPU interpreter's bf16 dot is wrong: fp32 dots there
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    return kt, v


@triton.jit
def _fold(q_a, q_b, k_base, v_base, j, jm, da, db, da_ok, db_ok, s_kn, s_vn, m, lsum, acc_a,
          acc_b, qk_scale, MASK_J: tl.constexpr, MASK_A: tl.constexpr, MASK_B: tl.constexpr,
          HAS_B: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one key block (keys ``j`` [N], valid where ``jm``) into the online softmax."""
    k_a, v_a = _load_block(k_base, v_base, j, jm, da, da_ok, s_kn, s_vn, MASK_J, MASK_A, UPCAST)
    s = tl.dot(q_a, k_a, input_precision=PRECISION)
    if HAS_B:
        k_b, v_b = _load_block(k_base, v_base, j, jm, db, db_ok, s_kn, s_vn, MASK_J, MASK_B,
                               UPCAST)
        s = tl.dot(q_b, k_b, s, input_precision=PRECISION)
    s = s * qk_scale  # [M, N] fp32, log2 units
    if MASK_J:  # keys past Lk score -inf (every row keeps >= 1 valid key in its block)
        s = s + tl.where(jm, 0.0, float("-inf"))[None, :]
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    p = p.to(v_a.dtype)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None], input_precision=PRECISION)
    if HAS_B:
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None], input_precision=PRECISION)
    return m_new, lsum, acc_a, acc_b


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _dense_attn_kernel(
    Q, K, V, Out, s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    H, Lq, Lk, qk_scale,
    HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    mblk = tl.program_id(0)  # fastest: the q blocks of one (batch, head) run together (L2)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    HAS_B: tl.constexpr = D_B > 0
    MASK_A: tl.constexpr = D_A > HEAD_DIM
    MASK_B: tl.constexpr = D_A + D_B > HEAD_DIM
    W_B: tl.constexpr = D_B if HAS_B else 16  # placeholder width when there is no chunk b
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    rmask = rows < Lq
    da = tl.arange(0, D_A)
    db = D_A + tl.arange(0, W_B)
    da_ok = da < HEAD_DIM
    db_ok = db < HEAD_DIM
    q_ptr = Q + b * s_qb + h * s_qh + rows[:, None].to(tl.int64) * s_qm
    q_a = tl.load(q_ptr + da[None, :], mask=rmask[:, None] & da_ok[None, :], other=0.0)
    q_b = tl.load(q_ptr + db[None, :], mask=rmask[:, None] & db_ok[None, :],
                  other=0.0)
    if UPCAST:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh

    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, W_B], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    n_full = Lk // BLOCK_N
    for nb in range(0, n_full):  # whole key blocks: no key mask
        j = (nb * BLOCK_N + cols).to(tl.int64)  # [N]
        m, lsum, acc_a, acc_b = _fold(q_a, q_b, k_base, v_base, j, j < Lk, da, db, da_ok,
                                      db_ok, s_kn, s_vn, m, lsum, acc_a, acc_b, qk_scale,
                                      False, MASK_A, MASK_B, HAS_B, PRECISION, UPCAST)
    if n_full * BLOCK_N < Lk:  # the last, partial key block
        j = (n_full * BLOCK_N + cols).to(tl.int64)
        m, lsum, acc_a, acc_b = _fold(q_a, q_b, k_base, v_base, j, j < Lk, da, db, da_ok,
                                      db_ok, s_kn, s_vn, m, lsum, acc_a, acc_b, qk_scale,
                                      True, MASK_A, MASK_B, HAS_B, PRECISION, UPCAST)

    inv = 1.0 / tl.where(lsum == 0.0, 1.0, lsum)  # no keys: acc == 0 -> 0
    o_ptr = Out + b * s_ob + h * s_oh + rows[:, None].to(tl.int64) * s_om
    tl.store(o_ptr + da[None, :], (acc_a * inv[:, None]).to(Out.dtype.element_ty),
             mask=rmask[:, None] & da_ok[None, :])
    if HAS_B:
        tl.store(o_ptr + db[None, :], (acc_b * inv[:, None]).to(Out.dtype.element_ty),
                 mask=rmask[:, None] & db_ok[None, :])


@dataclass(frozen=True)
class DenseTiles:
    """Launch shape of :func:`dense_attention` (``benchmarks/attn_headdim.py`` sweeps it)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


# The H200's best of benchmarks/attn_headdim.py's 16-shape sweep at every vision shape (Triton
# 3.6; RESULTS.md wave 24): 4-tile images 2.24 ms (cuDNN 2.24); 8 warps 2.69, 128 keys 2.61.
DEFAULT_TILES = DenseTiles()


def head_dim_chunks(D: int) -> tuple[int, int]:
    """``(D_A, D_B)``: two power-of-two chunks (>= 16) covering ``D`` with the least padding
    (80 -> (64, 16), 64 -> (64, 0), 96 -> (64, 32), 72 -> (64, 16) with 8 masked columns)."""
    if D <= 16:
        return 16, 0
    d_a = 1 << (D.bit_length() - 1)  # largest power of two <= D
    rest = D - d_a
    return d_a, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """``(B, H, Lq, D)`` of q ``[B, H, Lq, D]`` with k, v ``[B, H, Lk, D]``; ValueError else."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, L, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, H, Lk, D] "
                         f"with q's B, H, D = {B}, {H}, {D}")
    return B, H, Lq, D


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    out: torch.Tensor | None = None, scale: float | None = None,
                    tiles: DenseTiles | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` per (batch, head), no mask; see the module docstring.

    q ``[B, H, Lq, D]``; k, v ``[B, H, Lk, D]``; ``out`` ``[B, Lq, H, D]`` (allocated when
    None) is returned. ``scale`` defaults to ``D ** -0.5``. Raises ValueError on shapes, dtypes
    or devices that do not match."""
    B, H, Lq, D = check_qkv_shapes(q, k, v)
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} unsupported (1..{MAX_HEAD_DIM})")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if out is None:
        out = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (B, Lq, H, D) or out.dtype != q.dtype:
        raise ValueError(f"out must be [B, Lq, H, D] = {[B, Lq, H, D]} in {q.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    if len({t.device for t in (q, k, v, out)}) != 1:
        raise ValueError("q, k, v and out must be on one device")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if D > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last (head) dim")
    if B * H * Lq == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    t = tiles or DEFAULT_TILES
    fp32 = q.dtype == torch.float32
    block_n = min(t.block_n, 32) if fp32 else t.block_n  # IEEE fp32 tiles live in registers
    d_a, d_b = head_dim_chunks(D)
    grid = (triton.cdiv(Lq, t.block_m), B * H)
    _dense_attn_kernel[grid](
        q, k, v, out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(2),
        out.stride(1), H, Lq, k.shape[2], float(D ** -0.5 if scale is None else scale) * LOG2E,
        HEAD_DIM=D, D_A=d_a, D_B=d_b, BLOCK_M=t.block_m, BLOCK_N=block_n,
        PRECISION="ieee" if fp32 else "tf32", UPCAST=interpret and q.dtype != torch.float32,
        num_warps=t.num_warps, num_stages=t.num_stages)
    return out
