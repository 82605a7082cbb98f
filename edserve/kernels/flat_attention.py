"""Triton flat (token-indexed) attention: the paged pool viewed as page size 1.

Same contract as :func:`edserve.layers.attention.torch_ops.flat_attention`: key ``j`` of request
``b`` lives at slot ``req_to_token[req_pool_indices[b], kv_start[b] + j]``. Slots are read
straight from the request-to-token table (no copy), ``BLOCK_N`` keys per step whatever the pool's
page size, so every page size works (this is what SGLang and FlashInfer do).

Grid: (request, kv head, q block x kv split), GQA and split-KV as in
:mod:`edserve.kernels.paged_attention`. No host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import (
    LOG2E,
    _attend_block,
    _row_setup,
    _store_rows,
    block_m_for,
    check_common,
    check_index,
    tile_config,
)
from edserve.kernels.split_kv import choose_num_splits, combine_splits, split_workspaces

BLOCK_N = 64  # keys per loop step, page size independent (fp32 extend: 32, see tile_config)


# Batch-dependent scalars are not specialised, so new batch sizes reuse the compiled kernel.
@triton.jit(do_not_specialize=["num_tokens", "NUM_SPLITS"])
def _flat_attn_kernel(
    Q, K, V, Out, PartO, PartLse, KvRanges, ReqToToken, ReqPoolIdx, KvStart, KvLens, CuQ,
    stride_rg, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_rt, qk_scale, num_tokens, num_q_heads, NUM_SPLITS,
    G: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_RANGES: tl.constexpr, IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    pid = tl.program_id(2)
    qblk = pid // NUM_SPLITS
    split = pid % NUM_SPLITS
    tok, hg, row_valid, first, lim, kv_begin, kv_end, q_len = _row_setup(
        CuQ, KvLens, KvRanges, stride_rg, b, qblk, G, QPB, BLOCK_M, CAUSAL, HAS_RANGES)
    if qblk * QPB >= q_len:  # q block past this request's queries: nothing to write
        return
    hq = kvh * G + hg  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # This split's key blocks: [lo, hi) of the cdiv(kv_end, BLOCK_N) blocks the q block sees.
    blk0 = kv_begin // BLOCK_N
    n_blocks = tl.maximum(tl.cdiv(kv_end, BLOCK_N) - blk0, 0)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    lo = blk0 + split * per_split
    hi = blk0 + tl.minimum(n_blocks, split * per_split + per_split)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    r2t = ReqToToken + row * stride_rt + tl.load(KvStart + b)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    offs = tl.arange(0, BLOCK_N)

    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n in range(lo, hi):
        j = n * BLOCK_N + offs  # [BLOCK_N] key positions
        kmask = j < kv_end
        slot = tl.load(r2t + j, mask=kmask, other=0).to(tl.int64)  # [BLOCK_N]
        m, lsum, acc = _attend_block(q, k_base, v_base, slot, kmask, d, dmask, stride_kt,
                                     stride_vt, j, first, lim, m, lsum, acc, qk_scale,
                                     PRECISION, UPCAST)

    _store_rows(Out, PartO, PartLse, acc, m, lsum, tok, hq, row_valid, d, split, num_tokens,
                num_q_heads, stride_ot, stride_oh, HEAD_DIM, IS_SPLIT)


def flat_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   kv_start: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor,
                   max_q: int, causal: bool, scale: float,
                   kv_ranges: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                   num_splits: int | None = None, memo: dict | None = None) -> torch.Tensor:
    """Token-indexed attention; semantics of ``torch_ops.flat_attention``.

    q ``[T, Hq, D]``; k_cache/v_cache ``[num_slots, Hkv, D]``; req_to_token ``[rows, cols]``;
    req_pool_indices, kv_start, kv_lens ``[B]``; cu_q ``[B+1]`` (int32 or int64). ``max_q`` must
    be >= every request's query count and ``cu_q`` must partition ``[0, T)``. ``kv_ranges``
    ``[T, 2]`` optionally restricts query t to keys ``start <= j < end`` (as in torch_ops).
    ``out`` (optional, like q) receives the result; ``num_splits`` forces the split-KV factor
    (None: automatic from shapes; 1: never split); ``memo`` (the torch ops' per-batch scratch)
    is not needed: the kernel reads ``req_to_token`` itself. Returns ``[T, Hq, D]`` in q's
    dtype.
    """
    T, Hq, Hkv, D, B = check_common(q, k_cache, v_cache, kv_lens, cu_q, max_q, kv_ranges,
                                   out)
    if req_to_token.dim() != 2 or req_pool_indices.shape != (B,) or kv_start.shape != (B,):
        raise ValueError(f"need req_to_token [rows, cols], req_pool_indices [B] and kv_start [B] "
                         f"with B={B}; got {tuple(req_to_token.shape)}, "
                         f"{tuple(req_pool_indices.shape)}, {tuple(kv_start.shape)}")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("kv_start", kv_start)):
        check_index(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be contiguous along its columns")
    if out is None:
        out = torch.empty_like(q)
    if T == 0:
        return out
    if B == 0 or max_q == 0:
        return out.zero_()

    G = Hq // Hkv
    block_m, qpb = block_m_for(max_q, G)
    n_qblk = triton.cdiv(max_q, qpb)
    block_d = max(16, triton.next_power_of_2(D))
    block_n, cfg = tile_config(block_m, block_d, q.dtype, BLOCK_N)
    if num_splits is None:
        num_splits = choose_num_splits(B * Hkv * n_qblk, req_to_token.shape[1], block_n,
                                       q.device, bool(causal))
    num_splits = max(1, int(num_splits))
    part_o = part_lse = out  # unused placeholders when not splitting
    rng = kv_ranges if kv_ranges is not None else cu_q  # placeholder without ranges
    if num_splits > 1:
        part_o, part_lse = split_workspaces(num_splits, T, Hq, D, q.device)
    _flat_attn_kernel[(B, Hkv, n_qblk * num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, rng, req_to_token, req_pool_indices, kv_start,
        kv_lens, cu_q, rng.stride(0), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), float(scale) * LOG2E, T, Hq, num_splits,
        G=G, QPB=qpb, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, BLOCK_D=block_d,
        CAUSAL=bool(causal), HAS_RANGES=kv_ranges is not None, IS_SPLIT=num_splits > 1, **cfg)
    if num_splits > 1:
        combine_splits(part_o, part_lse, out)
    return out
