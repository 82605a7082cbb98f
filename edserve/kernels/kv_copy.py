"""Triton kernel: ``K[dst[i]] = K[src[i]]`` and ``V[dst[i]] = V[src[i]]`` for one layer of the
KV pool, where a pair with ``src[i] == dst[i]`` moves nothing (no load, no store).

Device beam reorders copy each row's partial last page with a fixed-shape index (``[rows,
page_size - 1]`` pairs, padding ``0 -> 0`` for slots not copied, so the step needs no host
read): through ``index_put`` every pair moved its bytes, padding included, twice (a gather
into a temporary, then the scatter; ``index_put`` ran at ~0.8 TB/s on the H200, see
``kv_write``). Large-v3 at 320 beam rows and page 128 has 40,640 pairs x 32 layers x K and V
(6.7 GB of pairs a step, each moved twice: ~27 GB of index-op traffic), by its bytes the bulk
of why its device-beam step measured 47 ms against the host-chosen beams' 22 ms
(benchmarks/RESULTS.md, wave 5); most pairs are padding. Here a program copies
``ROWS`` pairs x ``BLOCK_W`` columns with one index load per pair, and a padding pair's
masked load and store touch no memory: the cost follows the slots really copied.

A bit copy: the caller passes integer views of the buffers (any float dtype, float8
included). Pairs must not overlap (no ``dst`` is another pair's ``src``; the programs run in
no order). Only long-stable ``triton.language`` ops: compiles on real GPUs, runs under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_kv_rows_kernel(
    K, V,  # [slots, W] contiguous integer views of one layer's buffers
    Src, Dst,  # [N] int64 slots
    n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W]
    row_ok = rows < n_rows
    src = tl.load(Src + rows, mask=row_ok, other=0).to(tl.int64)
    dst = tl.load(Dst + rows, mask=row_ok, other=0).to(tl.int64)
    mask = (row_ok & (src != dst))[:, None] & (cols[None, :] < WIDTH)  # [ROWS, BLOCK_W]
    s = src[:, None] * WIDTH + cols[None, :]
    d = dst[:, None] * WIDTH + cols[None, :]
    tl.store(K + d, tl.load(K + s, mask=mask), mask=mask)
    tl.store(V + d, tl.load(V + s, mask=mask), mask=mask)


def _bits(buf: torch.Tensor) -> torch.Tensor:
    """``[slots, H, D]`` contiguous -> ``[slots, H * D]`` integer view of the same bytes."""
    assert buf.is_contiguous()
    return buf.view(_BITS[buf.element_size()]).view(buf.shape[0], -1)


def copy_kv_rows(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor,
                 dst: torch.Tensor) -> None:
    """``k[dst[i]] = k[src[i]]``, ``v[dst[i]] = v[src[i]]`` (bit-exact; pairs with
    ``src == dst`` are skipped). k, v: ``[slots, H, D]`` contiguous, one dtype; src, dst:
    ``[N]`` int64 on their device (the caller checks bounds and that no ``dst`` is a
    ``src``). One launch for K and V."""
    n = src.shape[0]
    if n == 0:
        return
    kb, vb = _bits(k), _bits(v)
    width = kb.shape[1]
    if os.environ.get("TRITON_INTERPRET") == "1":  # few large programs: cheap to interpret
        rows, block_w = 512, triton.next_power_of_2(width)
    else:
        rows, block_w = 8, min(256, triton.next_power_of_2(width))
    grid = (triton.cdiv(n, rows), triton.cdiv(width, block_w))
    _copy_kv_rows_kernel[grid](kb, vb, src.contiguous(), dst.contiguous(), n, WIDTH=width,
                               ROWS=rows, BLOCK_W=block_w)
