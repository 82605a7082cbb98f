"""One read of the logits for the sampler: every row's argmax and logsumexp, and the top-k
log-probabilities of the rows that ask (beam candidates), in two Triton launches.

A beam step at 64 requests x beam 5 holds ``[320, 51866]`` fp32 logits (66 MB). torch read
them four times (argmax, logsumexp's max, exp and sum passes) before the top-k kernel read them
again: 0.24 ms of a ~8 ms large-v3 step on the H200, 0.08 ms here (benchmarks/row_topk_gpu.py).
Each row is cut into ``SPLIT`` column chunks (flash-decoding's split, for parallelism: one
program per (row, chunk)):

* the chunk's max, its first column, its sum of ``exp(x - max)`` and, for a top-k row, its
  running top-k (:func:`~edserve.kernels.row_topk.topk_push`: a block whose max does not beat
  the running k-th value is skipped) go to fp32 / int32 workspaces;
* a second launch, one program a row, merges the chunks: the max and its first column (the
  chunks are in column order, so the smallest column among those holding the max: torch's
  first-index argmax), ``lse = M + log(sum_s S_s exp(M_s - M))``, and the top-k of the chunks'
  top-k by (value desc, token id asc), written minus ``lse``: log-probabilities.

Rows whose logits are all ``-inf`` get argmax 0 and lse ``-inf`` (torch's); a top-k row with
fewer than ``k`` finite logits gets distinct ``-inf`` ids, smallest first (as ``row_topk``).
NaN logits are not supported. No host syncs: safe under CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import check_logit_rows
from edserve.kernels.row_topk import MAX_K, topk_push

INT_MAX = tl.constexpr(2147483647)
# (chunks per row, logits per block, warps) by rows: enough programs for the H200's 132 SMs
# (benchmarks/row_topk_gpu.py --stats measures them)
MANY_ROWS = 128
SHAPE_MANY = (4, 2048, 4)
SHAPE_FEW = (16, 1024, 4)


@triton.jit
def _chunk_kernel(Logits, Slot, PM, PS, PA, PV, PI, stride_l, n_cols, chunk,
                  SPLIT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    base = Logits + b * stride_l
    want = False
    if K > 0:
        want = tl.load(Slot + b) >= 0
    slot = tl.arange(0, KP)
    live = slot < K  # padding slots (K..KP) hold +inf: never the minimum, never written
    tv = tl.where(live, float("-inf"), float("inf"))  # [KP] running top-k values (unsorted)
    ti = tl.where(live, -1, INT_MAX)  # [KP] their token ids; -1: an empty slot
    offs = tl.arange(0, BLOCK)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    m_run = tl.full([], float("-inf"), tl.float32)
    s_run = tl.zeros([], tl.float32)
    arg = lo  # all -inf: the chunk's first column (the merge then picks column 0)
    for start in range(lo, hi, BLOCK):
        col = start + offs
        x = tl.load(base + col, mask=col < hi, other=float("-inf"))  # [BLOCK]
        mb = tl.max(x, 0)
        first = tl.min(tl.where(x == mb, col, INT_MAX), 0)
        arg = tl.where(mb > m_run, first, arg)
        m_new = tl.maximum(m_run, mb)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - ref) + tl.sum(tl.exp(x - ref), 0)
        m_run = m_new
        if K > 0:
            empty = tl.max((ti < 0).to(tl.int32), 0) > 0
            if want & ((mb > tl.min(tv, 0)) | empty):
                tv, ti = topk_push(x, col, hi, tv, ti, slot, live, K, KP)
    at = b * SPLIT + s
    tl.store(PM + at, m_run)
    tl.store(PS + at, s_run)
    tl.store(PA + at, arg)
    if K > 0:
        if want:
            tl.store(PV + at * KP + slot, tv, mask=live)
            tl.store(PI + at * KP + slot, ti, mask=live)


@triton.jit
def _merge_kernel(Slot, PM, PS, PA, PV, PI, Argmax, Lse, Vals, Idx,
                  SPLIT: tl.constexpr, SP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    ok = s < SPLIT
    pm = tl.load(PM + b * SPLIT + s, mask=ok, other=float("-inf"))  # [SP]
    ps = tl.load(PS + b * SPLIT + s, mask=ok, other=0.0)
    pa = tl.load(PA + b * SPLIT + s, mask=ok, other=INT_MAX)
    m = tl.max(pm, 0)
    ref = tl.where(m == float("-inf"), 0.0, m)
    lse = m + tl.log(tl.sum(ps * tl.exp(pm - ref), 0))
    tl.store(Argmax + b, tl.min(tl.where(pm == m, pa, INT_MAX), 0).to(tl.int64))
    tl.store(Lse + b, lse)
    if K > 0:
        g = tl.load(Slot + b)
        if g >= 0:
            j = tl.arange(0, KP)
            at = (b * SPLIT + s)[:, None] * KP + j[None, :]  # [SP, KP]
            valid = ok[:, None] & (j < K)[None, :]
            v = tl.load(PV + at, mask=valid, other=float("-inf"))
            t = tl.load(PI + at, mask=valid, other=INT_MAX)
            v = tl.where(t < 0, float("-inf"), v)  # a chunk's empty slot ranks last
            t = tl.where(t < 0, INT_MAX, t)
            for r in tl.static_range(K):  # largest first; ties: smaller token id first
                best = tl.max(tl.max(v, 1), 0)
                tok = tl.min(tl.min(tl.where(v == best, t, INT_MAX), 1), 0)
                tl.store(Vals + g * K + r, best - lse)
                tl.store(Idx + g * K + r, tok.to(tl.int64))
                taken = (v == best) & (t == tok)
                v = tl.where(taken, float("-inf"), v)
                t = tl.where(taken, INT_MAX, t)


def logit_stats(logits: torch.Tensor, slot: torch.Tensor | None = None, topk_rows: int = 0,
                k: int = 0, *, shape: tuple[int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, V]`` float32 -> (argmax ``[B]`` int64, logsumexp ``[B]`` float32,
    top-k log-probabilities ``[G, k]`` float32 best first, their token ids ``[G, k]`` int64).

    ``slot``: ``[B]`` int32/int64, the top-k output row of each batch row (``-1``: none), for
    ``topk_rows`` = G output rows (every slot in ``0..G-1`` used once); ``k = 0``: no top-k.
    ``shape``: (chunks per row, logits per block (a power of two), warps); None: by ``B``."""
    B, V = check_logit_rows(logits)
    if k:
        if not 1 <= k <= min(MAX_K, V):
            raise ValueError(f"k must be in [1, min({MAX_K}, V={V})], got {k}")
        if slot is None or slot.shape != (B,) or slot.dtype not in (torch.int32, torch.int64) \
                or slot.device != logits.device:
            raise ValueError("slot must be a [B] int32/int64 tensor on the logits' device")
    split, block, warps = shape or (SHAPE_MANY if B >= MANY_ROWS else SHAPE_FEW)
    chunk = triton.cdiv(triton.cdiv(V, split), block) * block  # whole blocks a chunk
    split = triton.cdiv(V, chunk)  # no empty chunk
    KP = max(2, triton.next_power_of_2(max(k, 1)))
    dev = logits.device
    f32 = torch.float32
    argmax, lse = torch.empty(B, dtype=torch.int64, device=dev), torch.empty(B, dtype=f32,
                                                                              device=dev)
    vals = torch.empty(topk_rows, k, dtype=f32, device=dev)
    idx = torch.empty(topk_rows, k, dtype=torch.int64, device=dev)
    if B == 0:
        return argmax, lse, vals, idx
    pm, ps = (torch.empty(B, split, dtype=f32, device=dev) for _ in range(2))
    pa = torch.empty(B, split, dtype=torch.int32, device=dev)
    pv = torch.empty(B if k else 1, split, KP, dtype=f32, device=dev)
    pi = torch.empty(B if k else 1, split, KP, dtype=torch.int32, device=dev)
    slot = slot.contiguous() if k else argmax  # unread without top-k
    _chunk_kernel[(B, split)](logits, slot, pm, ps, pa, pv, pi, logits.stride(0), V, chunk,
                              SPLIT=split, K=k, KP=KP, BLOCK=block, num_warps=warps)
    _merge_kernel[(B,)](slot, pm, ps, pa, pv, pi, argmax, lse, vals, idx, SPLIT=split,
                        SP=max(2, triton.next_power_of_2(split)), K=k, KP=KP, num_warps=1)
    return argmax, lse, vals, idx
