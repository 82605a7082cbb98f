"""Triton kernel: ``K[loc[i]] = k[i]`` and ``V[loc[i]] = v[i]`` for one layer of the KV pool.

A slot's row (``num_kv_heads * head_dim`` elements, contiguous in the pool) is copied as a
block: each program moves ``ROWS`` rows x ``BLOCK_W`` columns of K and of V with one index load
per row, where ``index_put`` computes an offset per element (on the H200 the cross K/V writes
of large-v3, 16 clips x 32 layers, took 9.8 ms at ~0.8 TB/s). The sources may be strided views
(a layer's k or v inside the one cross-K/V GEMM output) whose rows are contiguous. A pure copy:
sources already have the pool's dtype (the pool casts first, in torch). Only long-stable
``triton.language`` ops: compiles on real GPUs, runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_rows_kernel(
    K, V,  # [N, W] sources (row strides stride_k, stride_v; columns contiguous)
    KDst, VDst,  # [slots, W] contiguous pool buffers of one layer
    Loc,  # [N] int32/int64: destination slot of each row
    n_rows, stride_k, stride_v,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W]
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < WIDTH)  # [ROWS, BLOCK_W]
    slot = tl.load(Loc + rows, mask=row_ok, other=0).to(tl.int64)
    r = rows.to(tl.int64)
    dst = slot[:, None] * WIDTH + cols[None, :]
    k = tl.load(K + r[:, None] * stride_k + cols[None, :], mask=mask)
    tl.store(KDst + dst, k, mask=mask)
    v = tl.load(V + r[:, None] * stride_v + cols[None, :], mask=mask)
    tl.store(VDst + dst, v, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` -> ``[N, H * D]`` view with contiguous rows (a copy only if it has none)."""
    n, h, d = t.shape
    if t.stride(2) != 1 or t.stride(1) != d:
        t = t.contiguous()
    return t.as_strided((n, h * d), (t.stride(0), 1))


def write_kv_rows(k_dst: torch.Tensor, v_dst: torch.Tensor, loc: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> None:
    """``k_dst[loc[i]] = k[i]``, ``v_dst[loc[i]] = v[i]`` (bit-exact copies).

    k_dst, v_dst: ``[slots, H, D]`` contiguous; k, v: ``[N, H, D]`` of the same dtype, any
    strides; loc: ``[N]`` int32/int64 (the caller checks bounds). One launch."""
    n = loc.shape[0]
    if n == 0:
        return
    assert k_dst.is_contiguous() and v_dst.is_contiguous()
    assert k.dtype == v.dtype == k_dst.dtype == v_dst.dtype, "cast before the copy"
    width = k_dst.shape[1] * k_dst.shape[2]
    ks, vs, loc = _rows(k), _rows(v), loc.contiguous()
    if os.environ.get("TRITON_INTERPRET") == "1":  # few large programs: cheap to interpret
        rows, block_w = 512, triton.next_power_of_2(width)
    else:
        rows, block_w = 8, min(256, triton.next_power_of_2(width))
    grid = (triton.cdiv(n, rows), triton.cdiv(width, block_w))
    _write_kv_rows_kernel[grid](ks, vs, k_dst, v_dst, loc, n, ks.stride(0), vs.stride(0),
                                WIDTH=width, ROWS=rows, BLOCK_W=block_w)
