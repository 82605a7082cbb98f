"""Triton kernel: ``K[dst[i]] = K[src[i]]`` and ``V[dst[i]] = V[src[i]]`` for one layer of the
KV pool, where a pair with ``src[i] == dst[i]`` moves nothing (no load, no store).

Device beam reorders copy each row's partial last page with a fixed-shape index (``[rows,
page_size - 1]`` pairs, padding ``0 -> 0`` for slots not copied, so the step needs no host
read): through ``index_put`` every pair moved its bytes, padding included, twice (a gather
into a temporary, then the scatter; ``index_put`` ran at ~0.8 TB/s on the H200, see
``kv_write``). Large-v3 at 320 beam rows and page 128 has 40,640 pairs x 32 layers x K and V
(6.7 GB of pairs a step, each moved twice: ~27 GB of index-op traffic), by its bytes the bulk
of why its device-beam step measured 47 ms against the host-chosen beams' 22 ms
(benchmarks/RESULTS.md, wave 5); most pairs are padding. Here a program takes ``ROWS``
pairs, returns at once when none of them moves, and otherwise copies the moving ones'
whole rows in ``BLOCK_W``-column steps; a padding pair's masked load and store touch no
memory. The first version ran a program per 8 pairs x 256 columns: 25,400 programs a layer
at 320 rows, almost all of them finding only padding, 0.52 ms a large-v3 beam step on the
H200 (wave 26) whatever was copied; programs of 64 pairs that stop early are 20x fewer.

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

ROWS = 64  # pairs a program (a beam reorder's row has page_size - 1 pairs)
BLOCK_W = 128  # columns a copy step: [64, 128] elements over 8 warps
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_kv_rows_kernel(
    K, V,  # [slots, W] contiguous integer views of one layer's buffers
    Src, Dst,  # [N] int64 slots
    n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = rows < n_rows
    src = tl.load(Src + rows, mask=row_ok, other=0).to(tl.int64)
    dst = tl.load(Dst + rows, mask=row_ok, other=0).to(tl.int64)
    moves = row_ok & (src != dst)  # [ROWS]
    if tl.max(moves.to(tl.int32), 0) == 0:  # only padding (most programs of a beam step)
        return
    for w0 in range(0, WIDTH, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask = moves[:, None] & (cols[None, :] < WIDTH)  # [ROWS, BLOCK_W]
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
        rows, block_w, warps = 512, triton.next_power_of_2(width), 4
    else:
        rows, block_w, warps = ROWS, min(BLOCK_W, triton.next_power_of_2(width)), 8
    _copy_kv_rows_kernel[(triton.cdiv(n, rows),)](
        kb, vb, src.contiguous(), dst.contiguous(), n, WIDTH=width, ROWS=rows,
        BLOCK_W=block_w, num_warps=warps)
