"""Triton bidirectional attention whose tiles move through TMA tensor descriptors (Hopper+).

The same function as :mod:`edserve.kernels.dense_attention` (``softmax(q k^T * scale) v`` per
(batch, head), no mask) for power-of-two head dims, written for the Whisper encoder's shape
(20 heads of 64, 1500 tokens): q, k and v are read as 4-D descriptors over their strided views
(``[B, H, L, D]``, e.g. the fused qkv projection's output seen per head), so a tile load is one
TMA copy instead of ``BLOCK x D`` address computations, and rows past ``L`` come back as zeros
without masks; the output is stored through a ``[B, Lq, H, D]`` descriptor (rows past ``Lq``
are clipped by the copy engine). The score scale is folded into the exponent's FMA
(``exp2(s * c - m)``) and only the last, partial key block is masked.

Contract: q ``[B, H, Lq, D]``, k and v ``[B, H, Lk, D]`` with unit stride on D, every other
stride and the base addresses 16-byte aligned (TMA's rule); D a power of two in 16..128;
``out`` ``[B, Lq, H, D]`` likewise. ``Lk == 0`` gives zeros. No host syncs. On CPU the Triton
interpreter runs it (tests); whether it beats cuDNN is measured in
``benchmarks/attn_tma_gpu.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from edserve.kernels.common import LOG2E

_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _online_softmax(s, j, Lk, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr,
                    MASK: tl.constexpr):
    """Scores ``s`` [M, N] of keys ``[j, j + N)`` (``MASK``: some are past Lk) -> (p [M, N],
    new max, new sum, the accumulator rescaled to the new max)."""
    if MASK:
        cols = j + tl.arange(0, BLOCK_N)
        s = tl.where((cols < Lk)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units (qk_scale > 0)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _fold_block(qa, qb, k_desc, v_desc, b, h, j, Lk, ma, la, acca, mb, lb, accb, qk_scale,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                HALVES: tl.constexpr, UPCAST: tl.constexpr):
    """Fold keys ``[j, j + BLOCK_N)`` into the online softmax of one or two q tiles. With two,
    both score dots are issued before either softmax, so one tile's tensor-core work can run
    under the other's exponentials (the overlap FlashAttention-3 schedules by hand)."""
    k = k_desc.load([b, h, j, 0]).reshape(BLOCK_N, D)
    v = v_desc.load([b, h, j, 0]).reshape(BLOCK_N, D)
    if UPCAST:  # the CPU interpreter's bf16 dot is wrong: fp32 dots there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kt = tl.trans(k)
    sa = tl.dot(qa, kt)  # [M, N] fp32
    if HALVES == 2:
        sb = tl.dot(qb, kt)
    p, ma, la, acca = _online_softmax(sa, j, Lk, ma, la, acca, qk_scale, BLOCK_N, MASK)
    acca = tl.dot(p.to(v.dtype), v, acca)
    if HALVES == 2:
        p, mb, lb, accb = _online_softmax(sb, j, Lk, mb, lb, accb, qk_scale, BLOCK_N, MASK)
        accb = tl.dot(p.to(v.dtype), v, accb)
    return ma, la, acca, mb, lb, accb


@triton.jit
def _store_tile(o_desc, b, m0, h, acc, l_i, TILE_M: tl.constexpr, D: tl.constexpr):
    inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # no keys: acc == 0 -> 0
    o = (acc * inv[:, None]).to(o_desc.dtype)
    o_desc.store([b, m0, h, 0], o.reshape(1, TILE_M, 1, D))  # rows past Lq: clipped


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _tma_attn_kernel(q_desc, k_desc, v_desc, o_desc, H, Lq, Lk, qk_scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     STAGES: tl.constexpr, HALVES: tl.constexpr, UPCAST: tl.constexpr):
    mblk = tl.program_id(0)  # fastest: the q blocks of one (batch, head) share its K/V in L2
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    TILE_M: tl.constexpr = BLOCK_M // HALVES
    m0 = mblk * BLOCK_M
    qa = q_desc.load([b, h, m0, 0]).reshape(TILE_M, D)  # rows past Lq: zeros
    qb = qa
    if HALVES == 2:
        qb = q_desc.load([b, h, m0 + TILE_M, 0]).reshape(TILE_M, D)
    if UPCAST:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    ma = tl.zeros([TILE_M], dtype=tl.float32) - float("inf")
    la = tl.zeros([TILE_M], dtype=tl.float32)
    acca = tl.zeros([TILE_M, D], dtype=tl.float32)
    mb, lb, accb = ma, la, acca
    n_full = Lk // BLOCK_N
    for nb in tl.range(0, n_full, num_stages=STAGES):  # whole key blocks: no mask
        ma, la, acca, mb, lb, accb = _fold_block(
            qa, qb, k_desc, v_desc, b, h, nb * BLOCK_N, Lk, ma, la, acca, mb, lb, accb,
            qk_scale, D, BLOCK_N, False, HALVES, UPCAST)
    if n_full * BLOCK_N < Lk:  # the last, partial key block
        ma, la, acca, mb, lb, accb = _fold_block(
            qa, qb, k_desc, v_desc, b, h, n_full * BLOCK_N, Lk, ma, la, acca, mb, lb, accb,
            qk_scale, D, BLOCK_N, True, HALVES, UPCAST)
    _store_tile(o_desc, b, m0, h, acca, la, TILE_M, D)
    if HALVES == 2:
        _store_tile(o_desc, b, m0 + TILE_M, h, accb, lb, TILE_M, D)


@dataclass(frozen=True)
class TmaTiles:
    """Launch shape of :func:`tma_attention` (``benchmarks/attn_tma_gpu.py`` sweeps it)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    halves: int = 1  # q tiles per program (2: two BLOCK_M / 2 tiles, their dots interleaved)


# The H100's best of attn_tma_gpu.py's sweep at large-v3's encoder shape, 16 and 64 clips, in two
# calls (RESULTS.md wave 38): 0.452 / 1.796 ms against cuDNN's 0.484 / 1.897; two q tiles per
# program no faster with 4 warps and 2x slower with 8.
DEFAULT_TILES = TmaTiles()


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))


def check_tma_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> None:
    """Raise ValueError unless q/k/v/out meet the module's contract."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, L, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, H, Lk, D] "
                         f"with q's B, H, D = {B}, {H}, {D}")
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head_dim {D} unsupported (a power of two in 16..128)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if out.shape != (B, Lq, H, D) or out.dtype != q.dtype:
        raise ValueError(f"out must be [B, Lq, H, D] = {[B, Lq, H, D]} in {q.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    if len({t.device for t in (q, k, v, out)}) != 1:
        raise ValueError("q, k, v and out must be on one device")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if not _aligned(t):
            raise ValueError(f"{name} needs unit stride on D and 16-byte aligned strides and "
                             f"base (TMA); got strides {t.stride()}")


def tma_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  out: torch.Tensor | None = None, scale: float | None = None,
                  tiles: TmaTiles | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` per (batch, head), no mask; see the module docstring.

    q ``[B, H, Lq, D]``; k, v ``[B, H, Lk, D]``; ``out`` ``[B, Lq, H, D]`` (allocated when
    None) is returned. ``scale`` defaults to ``D ** -0.5``. Raises ValueError on shapes, dtypes,
    strides or devices that do not match."""
    B, H, Lq, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if out is None and q.dim() == 4:
        out = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device)
    check_tma_inputs(q, k, v, out)
    Lk = k.shape[2]
    if B * H * Lq == 0 or Lk == 0:
        return out.zero_()
    t = tiles or DEFAULT_TILES
    if t.halves not in (1, 2) or t.block_m % t.halves:
        raise ValueError(f"tiles.halves must be 1 or 2 and divide block_m; got {t}")
    tile_m = t.block_m // t.halves
    q_desc = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, tile_m, D])
    k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, t.block_n, D])
    v_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, t.block_n, D])
    o_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [1, tile_m, 1, D])
    grid = (triton.cdiv(Lq, t.block_m), B * H)
    _tma_attn_kernel[grid](
        q_desc, k_desc, v_desc, o_desc, H, Lq, Lk,
        float(D ** -0.5 if scale is None else scale) * LOG2E,
        D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages, HALVES=t.halves,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=t.num_warps, num_stages=t.num_stages)
    return out
