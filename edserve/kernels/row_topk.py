"""Triton top-k of selected logits rows in one pass: the beam candidates' ``torch.topk``.

A beam step asks for the top ``k`` (beam + 1) tokens of every beam row: ``torch.topk`` over
``[320, 51866]`` fp32 logits runs a radix select of ~10 kernels (~0.3 ms on the H200 per step, plus
the ``index_select`` copy of the rows), for 6 values a row. Here one program reads one row once,
in blocks, and keeps a running top-k:

* a block whose maximum does not beat the running k-th value (and no slot is still empty) is
  skipped after one max-reduction: past the first blocks almost every block is;
* otherwise ``k`` rounds take the block's largest remaining value and let it replace the
  running minimum if it is larger;
* at the end ``k`` rounds over the ``k`` slots write them largest first.

Ties go to the smaller token id (``torch.topk`` leaves their order unspecified). Slots start
empty, so a row with fewer than ``k`` finite logits still gets ``k`` distinct token ids (its
``-inf`` ones, smallest ids first), as ``torch.topk`` does. NaN logits are not supported (the
sampler's filters never write them). No host syncs: safe under CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import check_logit_rows

MAX_K = 64
# Launch shape by the number of rows, measured on the H200 (benchmarks/row_topk_gpu.py, 51,866
# logits, k = 6): 320 rows 73.6 us with 4096-logit blocks and 4 warps (torch.topk 337 us;
# 2048/4: 88.7), 64 rows 35.4 us with 16384/16 (4096/4: 50.4; torch 96.9). A grid with fewer
# rows than the GPU has SMs gets longer blocks and more warps per row.
MANY_ROWS = 128
SHAPE_MANY = (4096, 4)  # (logits per block, warps) for >= MANY_ROWS rows
SHAPE_FEW = (16384, 16)


@triton.jit
def topk_push(x, col, n_cols, tv, ti, slot, live, K: tl.constexpr, KP: tl.constexpr):
    """Let a block's values ``x`` ([BLOCK], at columns ``col``; columns ``>= n_cols`` are
    padding) into a running top-k (``tv``/``ti`` [KP] values and token ids, ``-1``: empty;
    ``live``: the first K of ``slot``): K rounds take the block's largest remaining value and
    let it replace an empty slot, else the running minimum if it is larger."""
    for _ in tl.static_range(K):
        m = tl.max(x, 0)
        p = tl.min(tl.where(x == m, col, 2147483647), 0)  # first column holding m
        cur = tl.min(tv, 0)
        # the slot to replace: an empty one first, else the smallest value (the larger
        # token id among equal values, so smaller ids survive)
        key = tl.where(ti < 0, 2147483647, tl.where(tv == cur, ti, -1))
        at = tl.max(tl.where(live, key, -1), 0)
        pos = tl.min(tl.where(live & (key == at), slot, KP), 0)
        take = (p < n_cols) & ((m > cur) | (at == 2147483647))
        hit = (slot == pos) & take
        tv = tl.where(hit, m, tv)
        ti = tl.where(hit, p, ti)
        x = tl.where(col == p, float("-inf"), x)
        col = tl.where(col == p, 2147483647, col)  # a taken column is never again
    return tv, ti


@triton.jit
def _row_topk_kernel(Logits, Rows, Vals, Idx, stride_l, n_cols, K: tl.constexpr,
                     KP: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + g).to(tl.int64)
    base = Logits + row * stride_l
    slot = tl.arange(0, KP)
    live = slot < K  # padding slots (K..KP) hold +inf: never the minimum, never written
    tv = tl.where(live, float("-inf"), float("inf"))  # [KP] running top-k values (unsorted)
    ti = tl.where(live, -1, 2147483647)  # [KP] their token ids; -1: an empty slot
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        col = start + offs
        x = tl.load(base + col, mask=col < n_cols, other=float("-inf"))  # [BLOCK]
        thr = tl.min(tv, 0)
        empty = tl.max((ti < 0).to(tl.int32), 0) > 0
        if (tl.max(x, 0) > thr) | empty:
            tv, ti = topk_push(x, col, n_cols, tv, ti, slot, live, K, KP)
    for r in tl.static_range(K):  # largest first; ties: smaller token id first
        m = tl.max(tl.where(live, tv, float("-inf")), 0)
        t = tl.min(tl.where(live & (tv == m), ti, 2147483647), 0)
        tl.store(Vals + g * K + r, m)
        tl.store(Idx + g * K + r, t.to(tl.int64))
        live = live & ~((tv == m) & (ti == t))


def row_topk(logits: torch.Tensor, rows: torch.Tensor, k: int, *, block: int | None = None,
             num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, V]`` float32, ``rows`` ``[G]`` int64 batch rows -> (values ``[G, k]``
    float32, token ids ``[G, k]`` int64), largest first: ``torch.topk(logits[rows], k)``.
    ``block`` (a power of two) and ``num_warps``: launch shape (None: by ``G``, measured)."""
    check_logit_rows(logits)
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) \
            or rows.device != logits.device:
        raise ValueError("rows must be a 1-D int32/int64 tensor on the logits' device")
    if not 1 <= k <= min(MAX_K, logits.shape[1]):
        raise ValueError(f"k must be in [1, min({MAX_K}, V={logits.shape[1]})], got {k}")
    G = rows.shape[0]
    auto_block, auto_warps = SHAPE_MANY if G >= MANY_ROWS else SHAPE_FEW
    block, num_warps = block or auto_block, num_warps or auto_warps
    vals = torch.empty(G, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(G, k, dtype=torch.int64, device=logits.device)
    if G:
        _row_topk_kernel[(G,)](logits, rows.contiguous(), vals, idx, logits.stride(0),
                               logits.shape[1], K=k, KP=max(2, triton.next_power_of_2(k)),
                               BLOCK=block, num_warps=num_warps)
    return vals, idx
