"""Triton grouped cross-attention for decode: the rows of a row group read their shared
encoder K/V once.

The rows of a beam / best_of group hold the same encoder region (their encoder pages are
shared; a copied partial page holds the same values), so in a decode step their queries can
be processed together against one K/V stream, as grouped-query attention processes the query
heads of one kv head together. A greedy row is a group of one.

Group structure: ``group_rows [G, W]`` (int32/int64) lists each group's batch rows, ``-1``
padding; a group whose first entry is ``-1`` is unused. The group's keys are those of its
first row ``lead = group_rows[g, 0]``: ``kv_lens[lead]`` keys starting at column 0 of the
lead's row, found either

* token by token (the flat strategy): key ``j`` at slot
  ``req_to_token[req_pool_indices[lead], j]``, or
* page by page (the aligned strategy): key ``j`` at slot
  ``page_table[lead, j // page_size] * page_size + j % page_size`` (any page size: a loop
  step reads an aligned slice of one page when the page size is a multiple of the step, else
  looks the page up per key).

The shape of ``group_rows`` depends only on the batch size (``[B, MAX_GROUP_ROWS]`` in the
engine), so one CUDA graph serves any mix of greedy rows and groups.

Grid: (group, kv head, member block x kv split). A program's rows are ``(member, head in kv
group)`` pairs, as in :mod:`edserve.kernels.common` with members in place of queries: each
K/V tile is loaded once for every member and every query head of its kv head. Decode only:
one query per batch row (``q`` row ``i`` is batch row ``i``). Every batch row must be listed in
exactly one group (rows listed nowhere are not written). Split-KV as in the other kernels; no
host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import (
    LOG2E,
    _attend_block,
    _store_rows,
    block_m_for,
    check_index,
    check_qkv,
    tile_config,
)
from edserve.kernels.split_kv import choose_num_splits, combine_splits, split_workspaces

BLOCK_N = 64  # keys per loop step by token, and the least by page (fp32: common.tile_config)
MAX_BLOCK_N_PAGED = 128  # by page: a step covers up to one 128-slot page (as paged_attention)
# Grid order. The pool stores a key as [kv heads, head_dim] (one head's slice: head_dim
# elements, 128 bytes for Whisper in bf16, then the next head's), and a program reads one kv
# head. With the kv head as the grid's fastest axis, the programs of every head of a row run
# side by side and read each key's whole [heads, head_dim] row together; with the group
# fastest, each key is read in 128-byte pieces far apart in time. Measured on the H200
# (benchmarks/cross_decode_gpu.py, large-v3, 1500 keys): 4-5 % faster at 64 rows (bf16 by page
# 136.2 -> 130.2 us, 3.77 TB/s), within 2 % either way at 16-32 rows.
HEADS_FIRST = True


@triton.jit(do_not_specialize=["num_tokens", "NUM_SPLITS"])
def _grouped_cross_kernel(
    Q, K, V, Out, PartO, PartLse, GroupRows, KvLens, Keys, PoolRows,
    stride_gr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_keys, qk_scale, num_tokens, num_q_heads, NUM_SPLITS,
    GH: tl.constexpr, MPB: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    """PAGE == 0: ``Keys`` is req_to_token (row of the lead: ``PoolRows[lead]``); PAGE > 0:
    ``Keys`` is the batch's page table (row ``lead``). HEADS_FIRST: the grid is (kv head,
    group, ...), else (group, kv head, ...)."""
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        g = tl.program_id(1).to(tl.int64)
    else:
        g = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
    pid = tl.program_id(2)
    mblk = pid // NUM_SPLITS
    split = pid % NUM_SPLITS
    group = GroupRows + g * stride_gr
    lead = tl.load(group).to(tl.int64)
    if lead < 0:  # an unused group slot
        return
    r = tl.arange(0, BLOCK_M)
    member = mblk * MPB + r // GH  # [BLOCK_M] index in the group
    hg = r % GH  # [BLOCK_M] head inside the kv head's group
    listed = (r < MPB * GH) & (member < WIDTH)
    rows = tl.load(group + member, mask=listed, other=-1).to(tl.int64)  # [BLOCK_M] batch rows
    row_valid = rows >= 0
    if tl.max(row_valid.to(tl.int32), 0) == 0:  # a member block past the group's rows
        return
    tok = tl.where(row_valid, rows, 0)  # [BLOCK_M] row of q / out
    kv_len = tl.load(KvLens + lead)
    first = tl.zeros([BLOCK_M], dtype=tl.int32)
    lim = first + kv_len - 1
    hq = kvh * GH + hg  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # This split's key blocks: [lo, hi) of the cdiv(kv_len, BLOCK_N) blocks of the region.
    n_blocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(n_blocks, lo + per_split)
    if PAGE == 0:
        key_row = Keys + tl.load(PoolRows + lead).to(tl.int64) * stride_keys
    else:
        key_row = Keys + lead * stride_keys
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    offs = tl.arange(0, BLOCK_N)

    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n in range(lo, hi):
        j = n * BLOCK_N + offs  # [BLOCK_N] key positions
        kmask = j < kv_len
        if PAGE == 0:
            slot = tl.load(key_row + j, mask=kmask, other=0).to(tl.int64)  # [BLOCK_N]
        elif PAGE % BLOCK_N == 0:  # an aligned slice of one page: contiguous slots
            page = tl.load(key_row + (n * BLOCK_N) // PAGE).to(tl.int64)
            slot = page * PAGE + (n * BLOCK_N) % PAGE + offs  # [BLOCK_N]
        else:  # small (or odd-sized) pages: a page per key
            page = tl.load(key_row + j // PAGE, mask=kmask, other=0).to(tl.int64)
            slot = page * PAGE + j % PAGE  # [BLOCK_N]
        m, lsum, acc = _attend_block(q, k_base, v_base, slot, kmask, d, dmask, stride_kt,
                                     stride_vt, j, first, lim, m, lsum, acc, qk_scale,
                                     PRECISION, UPCAST)

    _store_rows(Out, PartO, PartLse, acc, m, lsum, tok, hq, row_valid, d, split, num_tokens,
                num_q_heads, stride_ot, stride_oh, HEAD_DIM, IS_SPLIT)


def grouped_cross_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            group_rows: torch.Tensor, kv_lens: torch.Tensor, scale: float, *,
                            req_to_token: torch.Tensor | None = None,
                            req_pool_indices: torch.Tensor | None = None,
                            page_table: torch.Tensor | None = None, page_size: int = 0,
                            out: torch.Tensor | None = None,
                            num_splits: int | None = None,
                            heads_first: bool = HEADS_FIRST) -> torch.Tensor:
    """Decode cross-attention with one encoder read per row group (see the module doc).

    q ``[B, Hq, D]`` (one query per batch row); k_cache/v_cache ``[num_slots, Hkv, D]``;
    group_rows ``[G, W]``; kv_lens ``[B]`` encoder keys of each row (the lead's count is used).
    Keys by token: ``req_to_token [rows, cols]`` and ``req_pool_indices [B]``; or by page:
    ``page_table [B, max_pages]`` and ``page_size >= 1``. ``out`` (optional, like q) receives
    the result; ``num_splits`` forces the split-KV factor (None: from shapes); ``heads_first``
    orders the grid (:data:`HEADS_FIRST`). Rows with no key get zeros. Returns ``[B, Hq, D]``
    in q's dtype.
    """
    B, Hq, Hkv, D = check_qkv(q, k_cache, v_cache, out)
    if kv_lens.shape != (B,) or group_rows.dim() != 2 or group_rows.shape[0] > max(B, 1):
        raise ValueError(f"need kv_lens [B] and group_rows [G <= B, W] with B={B}; got "
                         f"{tuple(kv_lens.shape)}, {tuple(group_rows.shape)}")
    check_index("kv_lens", kv_lens)
    check_index("group_rows", group_rows)
    if group_rows.shape[1] > 1 and group_rows.stride(1) != 1:
        raise ValueError("group_rows must be contiguous along its columns")
    by_token = req_to_token is not None and req_pool_indices is not None
    if by_token == (page_table is not None) or (page_table is None) != (page_size == 0) \
            or page_size < 0:
        raise ValueError("give either req_to_token and req_pool_indices, or page_table and "
                         "page_size >= 1")
    if by_token:
        if req_to_token.dim() != 2 or req_pool_indices.shape != (B,):
            raise ValueError(f"need req_to_token [rows, cols] and req_pool_indices [{B}]; got "
                             f"{tuple(req_to_token.shape)}, {tuple(req_pool_indices.shape)}")
        check_index("req_to_token", req_to_token)
        check_index("req_pool_indices", req_pool_indices)
        keys, pool_rows, page = req_to_token, req_pool_indices, 0
    else:
        if page_table.dim() != 2 or page_table.shape[0] != B:
            raise ValueError(f"need page_table [{B}, max_pages]; got {tuple(page_table.shape)}")
        check_index("page_table", page_table)
        if k_cache.shape[0] % page_size != 0:
            raise ValueError(f"num_slots {k_cache.shape[0]} is not a multiple of page_size "
                             f"{page_size}")
        keys, pool_rows, page = page_table, kv_lens, page_size  # pool_rows: unused placeholder
    if keys.shape[1] > 1 and keys.stride(1) != 1:
        raise ValueError("the key index table must be contiguous along its columns")
    for name, t in (("group_rows", group_rows), ("kv_lens", kv_lens), ("key table", keys),
                    ("req_pool_indices", pool_rows)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if out is None:
        out = torch.empty_like(q)
    if B == 0 or group_rows.shape[0] == 0 or group_rows.shape[1] == 0:
        return out

    GH = Hq // Hkv
    width = group_rows.shape[1]
    block_m, mpb = block_m_for(width, GH)
    n_mblk = triton.cdiv(width, mpb)
    block_d = max(16, triton.next_power_of_2(D))
    pow2_page = page > 0 and page & (page - 1) == 0
    want_n = min(max(page, BLOCK_N), MAX_BLOCK_N_PAGED) if pow2_page else BLOCK_N
    block_n, cfg = tile_config(block_m, block_d, q.dtype, want_n)
    G = group_rows.shape[0]
    if num_splits is None:
        max_kv = keys.shape[1] * max(page, 1)
        num_splits = choose_num_splits(G * Hkv * n_mblk, max_kv, block_n, q.device)
    num_splits = max(1, int(num_splits))
    part_o = part_lse = out  # unused placeholders when not splitting
    if num_splits > 1:
        part_o, part_lse = split_workspaces(num_splits, B, Hq, D, q.device)
    grid = (Hkv, G, n_mblk * num_splits) if heads_first else (G, Hkv, n_mblk * num_splits)
    _grouped_cross_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, group_rows, kv_lens, keys, pool_rows,
        group_rows.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), keys.stride(0),
        float(scale) * LOG2E, B, Hq, num_splits,
        GH=GH, MPB=mpb, WIDTH=width, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        BLOCK_D=block_d, PAGE=page, IS_SPLIT=num_splits > 1, HEADS_FIRST=heads_first, **cfg)
    if num_splits > 1:
        combine_splits(part_o, part_lse, out)
    return out
