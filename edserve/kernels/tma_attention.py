"""Triton bidirectional attention whose tiles move through TMA tensor descriptors (Hopper+).

The same function as :mod:`edserve.kernels.dense_attention` (``softmax(q k^T * scale) v`` per
(batch, head), no mask), written for the Whisper encoder's shape (20 heads of 64, 1500 tokens)
and the Mllama vision tower's (16 heads of 80: read as two column chunks, 64 + 16, so the dots
do the work of 80 columns, not 128): q, k and v are read as 4-D descriptors over their strided views
(``[B, H, L, D]``, e.g. the fused qkv projection's output seen per head), so a tile load is one
TMA copy instead of ``BLOCK x D`` address computations, and rows past ``L`` come back as zeros
without masks; the output is stored through a ``[B, Lq, H, D]`` descriptor (rows past ``Lq``
are clipped by the copy engine). The score scale is folded into the exponent's FMA
(``exp2(s * c - m)``); keys past ``Lk`` in the last block are masked through the score
accumulator's initial value.

Contract: q ``[B, H, Lq, D]``, k and v ``[B, H, Lk, D]`` with unit stride on D, every other
stride and the base addresses 16-byte aligned (TMA's rule); D a power of two in 16..128 or
the sum of two (:func:`tma_chunks`);
``out`` ``[B, Lq, H, D]`` likewise. ``Lk == 0`` gives zeros. No host syncs. On CPU the Triton
interpreter runs it (tests); whether it beats cuDNN is measured in
``benchmarks/attn_tma_gpu.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from edserve.kernels.common import LOG2E
from edserve.kernels.dense_attention import DenseTiles, check_qkv_shapes

_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _fold_block(qa, qb, ka_desc, kb_desc, va_desc, vb_desc, b, h, j, Lk, m_i, l_i, acc_a,
                acc_b, qk_scale, D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Fold keys ``[j, j + BLOCK_N)`` into the online softmax. The head dim is read as two
    column chunks ``[0, D_A)`` and ``[D_A, D_A + D_B)`` (``D_B`` 0: one chunk): the score tile
    is ``qa ka^T + qb kb^T``, the output two accumulators. Keys past Lk (read as zeros) are
    masked by starting the score accumulator at -inf in their columns (no select after the
    dots: on the H200 a select after the 16-column chunk's dot in a separate tail block gave
    wrong sums, wave 38)."""
    cols = j + tl.arange(0, BLOCK_N)
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + \
        tl.where(cols < Lk, 0.0, float("-inf"))[None, :]
    ka = ka_desc.load([b, h, j, 0]).reshape(BLOCK_N, D_A)
    if UPCAST:  # the CPU interpreter's bf16 dot is wrong: fp32 dots there
        ka = ka.to(tl.float32)
    s = tl.dot(qa, tl.trans(ka), s)  # [M, N] fp32
    if D_B > 0:
        kb = kb_desc.load([b, h, j, 0]).reshape(BLOCK_N, D_B)
        if UPCAST:
            kb = kb.to(tl.float32)
        s = tl.dot(qb, tl.trans(kb), s)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units (qk_scale > 0)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    va = va_desc.load([b, h, j, 0]).reshape(BLOCK_N, D_A)
    if UPCAST:
        va = va.to(tl.float32)
    p = p.to(va.dtype)
    acc_a = tl.dot(p, va, acc_a * alpha[:, None])
    if D_B > 0:
        vb = vb_desc.load([b, h, j, 0]).reshape(BLOCK_N, D_B)
        if UPCAST:
            vb = vb.to(tl.float32)
        acc_b = tl.dot(p, vb, acc_b * alpha[:, None])
    return m_new, l_i, acc_a, acc_b


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _tma_attn_kernel(qa_desc, qb_desc, ka_desc, kb_desc, va_desc, vb_desc, oa_desc, ob_desc,
                     H, Lq, Lk, qk_scale, D_A: tl.constexpr, D_B: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                     UPCAST: tl.constexpr):
    mblk = tl.program_id(0)  # fastest: the q blocks of one (batch, head) share its K/V in L2
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = mblk * BLOCK_M
    W_B: tl.constexpr = D_B if D_B > 0 else 16  # placeholder width without a second chunk
    qa = qa_desc.load([b, h, m0, 0]).reshape(BLOCK_M, D_A)  # rows past Lq: zeros
    qb = tl.zeros([BLOCK_M, W_B], dtype=qa.dtype)
    if D_B > 0:
        qb = qb_desc.load([b, h, m0, 0]).reshape(BLOCK_M, D_B)
    if UPCAST:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, W_B], dtype=tl.float32)
    # one pipelined loop over every key block, the last one partial (its tail masked)
    for nb in tl.range(0, tl.cdiv(Lk, BLOCK_N), num_stages=STAGES):
        m_i, l_i, acc_a, acc_b = _fold_block(
            qa, qb, ka_desc, kb_desc, va_desc, vb_desc, b, h, nb * BLOCK_N, Lk, m_i, l_i,
            acc_a, acc_b, qk_scale, D_A, D_B, BLOCK_M, BLOCK_N, UPCAST)
    inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # no keys: acc == 0 -> 0
    o = (acc_a * inv[:, None]).to(oa_desc.dtype)
    oa_desc.store([b, m0, h, 0], o.reshape(1, BLOCK_M, 1, D_A))  # rows past Lq: clipped
    if D_B > 0:
        o = (acc_b * inv[:, None]).to(ob_desc.dtype)
        ob_desc.store([b, m0, h, 0], o.reshape(1, BLOCK_M, 1, D_B))


TmaTiles = DenseTiles  # launch shape (block_m, block_n, num_warps, num_stages), swept by
# benchmarks/attn_tma_gpu.py


# attn_tma_gpu.py's sweeps (RESULTS.md wave 38, H100 and H200): at large-v3's encoder shape
# (one 64-column chunk) 64 x 128 tiles with 4 warps were the best at 16 clips on both (0.460-
# 0.466 ms; cuDNN 0.476-0.482); at the 11B vision tower's (64 + 16 columns) 128 x 64 with 4
# warps and 3 stages (16 four-tile images 8.24 ms; the pointer-load kernel 8.57, cuDNN 9.58).
# (Two q tiles a program, both score dots issued before either softmax, were no faster with
# 4 warps and 2x slower with 8: not kept.)
DEFAULT_TILES = {False: TmaTiles(64, 128, 4, 2),  # by D_B > 0
                 True: TmaTiles(128, 64, 4, 3)}


def has_tma(device: torch.device) -> bool:
    """A CUDA device with TMA (compute capability 9.0+), which this kernel needs."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_chunks(D: int) -> tuple[int, int] | None:
    """``(D_A, D_B)``: the head dim as one power of two in 16..128 (``D_B == 0``) or the sum
    of two, the larger first (80 -> (64, 16)); None when it is neither."""
    sizes = (128, 64, 32, 16)
    for a in sizes:
        if D == a:
            return a, 0
        if D - a in sizes and D - a < a:
            return a, D - a
    return None


def tma_aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor can address (this kernel's, FlashAttention-3's): unit stride on
    the last dim, 16-byte aligned base and other strides."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))


def check_tma_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor | None) -> tuple[int, int, int, int]:
    """``(B, H, Lq, D)``; ValueError unless q/k/v and ``out`` (None: one to be allocated,
    which meets it) meet the module's contract."""
    B, H, Lq, D = check_qkv_shapes(q, k, v)
    if B * H > 65535:  # the grid's second axis
        raise ValueError(f"batch x heads = {B * H} exceeds 65535 (split the batch)")
    if tma_chunks(D) is None:
        raise ValueError(f"head_dim {D} unsupported (a power of two in 16..128, or the sum of "
                         f"two: 48, 80, 96, 144, 160, 192)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if out is not None and (out.shape != (B, Lq, H, D) or out.dtype != q.dtype):
        raise ValueError(f"out must be [B, Lq, H, D] = {[B, Lq, H, D]} in {q.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    tensors = {"q": q, "k": k, "v": v, **({} if out is None else {"out": out})}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError("q, k, v and out must be on one device")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"tma_attention runs on CUDA tensors (on the CPU only under "
                         f"TRITON_INTERPRET=1); got {q.device}")
    for name, t in tensors.items():
        if not tma_aligned(t):
            raise ValueError(f"{name} needs unit stride on D and 16-byte aligned strides and "
                             f"base (TMA); got strides {t.stride()}")
    return B, H, Lq, D


def tma_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  out: torch.Tensor | None = None, scale: float | None = None,
                  tiles: TmaTiles | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` per (batch, head), no mask; see the module docstring.

    q ``[B, H, Lq, D]``; k, v ``[B, H, Lk, D]``; ``out`` ``[B, Lq, H, D]`` (allocated when
    None) is returned. ``scale`` defaults to ``D ** -0.5``. Raises ValueError on shapes, dtypes,
    strides or devices that do not match."""
    B, H, Lq, D = check_tma_inputs(q, k, v, out)
    if out is None:
        out = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device)
    Lk = k.shape[2]
    if B * H * Lq == 0 or Lk == 0:
        return out.zero_()
    d_a, d_b = tma_chunks(D)
    t = tiles or DEFAULT_TILES[d_b > 0]

    def descs(x: torch.Tensor, block: list[int]) -> tuple[TensorDescriptor, TensorDescriptor]:
        """Descriptors of x's head-dim chunks [0, d_a) and [d_a, D) (the first twice when
        there is one chunk); ``block`` has -1 where the chunk's width goes."""
        a = TensorDescriptor(x, [*x.shape[:3], d_a], list(x.stride()),
                             [d_a if n < 0 else n for n in block])
        if not d_b:
            return a, a
        xb = x[..., d_a:]
        return a, TensorDescriptor(xb, list(xb.shape), list(xb.stride()),
                                   [d_b if n < 0 else n for n in block])

    qa, qb = descs(q, [1, 1, t.block_m, -1])
    ka, kb = descs(k, [1, 1, t.block_n, -1])
    va, vb = descs(v, [1, 1, t.block_n, -1])
    oa, ob = descs(out, [1, t.block_m, 1, -1])
    grid = (triton.cdiv(Lq, t.block_m), B * H)
    _tma_attn_kernel[grid](
        qa, qb, ka, kb, va, vb, oa, ob, H, Lq, Lk,
        float(D ** -0.5 if scale is None else scale) * LOG2E,
        D_A=d_a, D_B=d_b, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=t.num_warps, num_stages=t.num_stages)
    return out
