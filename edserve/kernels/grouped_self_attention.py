"""Triton grouped self-attention for decode: the rows of a row group read the decoder keys
they share once.

The rows of a beam group hold the same decoder tokens up to the point where their sequences
part, and wherever two rows hold the same tokens their decoder K/V hold the same values (key
``j`` is a function of tokens ``0..j``; a reordered row's copy is a bit copy). So a decode step
can read the group's shared prefix once, from its first row (the *lead*), for all its rows
together (as :mod:`edserve.kernels.grouped_cross_attention` reads the shared encoder region),
and then only each row's own keys past it::

    lead     | p p p p p p | a a      shared prefix: keys [0, shared) read once, by tl.dot
    member 1 | (lead's)    | b b b    own keys [shared, kv_len) read per row
    member 2 | (lead's)    | c

How many keys a group shares is found on the device from the sampled-token histories
(:class:`~edserve.engine.token_history.TokenHistory`, indexed by ``req_to_token`` row): a row's
decoder region holds ``base = kv_len - n`` keys before its ``n`` sampled tokens (the prompt,
written before the row's group forked), so with every member at the lead's ``base`` the group
shares ``base + lcp`` keys, ``lcp`` the longest common prefix of the members' histories; a group
whose members differ in ``base``, or whose lead's history is full (its last column is
overwritten at the length limit), shares nothing and every row reads its own keys. A group of
one (a greedy row) shares its whole region.

Keys of the decoder region (``region_start`` per batch row):

* by token (the flat strategy): key ``j`` of row ``b`` at slot
  ``req_to_token[req_pool_indices[b], region_start[b] + j]``;
* by page (the aligned strategy): at ``page_table[b, region_start[b] + j // page_size] *
  page_size + j % page_size``.

Group structure as in the grouped cross-attention kernel (``group_rows [G, W]``, ``-1``
padding, every batch row in exactly one group). Decode only: one query per batch row, causal
(a row sees all of its ``kv_len`` keys, the one written this step included). No GQA (query
heads == kv heads: Whisper's decoder). One program per (kv head, group). The members' own
keys are laid end to end in one list read in the same ``[BLOCK_N]`` tiles as the shared
prefix, each member seeing only its own range of the list (tensor-core dots, no tile wasted
on the members' different lengths). No host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import (
    LOG2E,
    _softmax_step,
    _store_rows,
    check_index,
    check_qkv,
    tile_config,
)

BLOCK_N = 64  # shared keys per loop step (and the least by page)
BLOCK_T = 64  # history columns compared per step


@triton.jit
def _shared_keys(Hist, HistLens, stride_hist, hist_cols, prow, valid, kv, r,
                 BLOCK_T: tl.constexpr):
    """Keys every valid member shares with member 0 (the lead); see the module doc."""
    alone = tl.sum(valid.to(tl.int32), 0) == 1  # a greedy row: shares its whole region
    need = (valid.to(tl.int32) * (1 - alone.to(tl.int32))) != 0  # (the interpreter's bool &)
    n = tl.load(HistLens + prow, mask=need, other=0).to(tl.int32)  # [M] sampled tokens
    lead = r == 0
    n0 = tl.sum(tl.where(lead, n, 0), 0)
    base0 = tl.sum(tl.where(lead, kv, 0), 0) - n0
    p0 = tl.sum(tl.where(lead, prow, 0), 0)
    same = tl.max((valid & (kv - n != base0)).to(tl.int32), 0) == 0
    lcp = n0
    for c0 in range(0, tl.where(alone, 0, n0), BLOCK_T):
        c = c0 + tl.arange(0, BLOCK_T)  # [T] history columns
        inside = c < n0
        lt = tl.load(Hist + p0 * stride_hist + c, mask=inside, other=0)  # [T]
        mt = tl.load(Hist + prow[:, None] * stride_hist + c[None, :],
                     mask=valid[:, None] & inside[None, :], other=0)  # [M, T]
        differ = valid[:, None] & inside[None, :] & (
            (mt != lt[None, :]) | (c[None, :] >= n[:, None]))
        first = tl.min(tl.min(tl.where(differ, c[None, :], n0), 1), 0)
        lcp = tl.minimum(lcp, first)
    ok = (same & (n0 < hist_cols) & (base0 >= 0)) | alone
    shared = tl.where(ok, base0 + lcp, 0)
    return tl.minimum(shared, tl.min(tl.where(valid, kv, 2147483647), 0))


@triton.jit
def _key_slots(Keys, stride_keys, key_row, start, j, inside, PAGE: tl.constexpr):
    """Pool slots of decoder keys ``j`` (any shape) of rows whose table row is ``key_row``
    and region start ``start`` (both broadcast to ``j``)."""
    if PAGE == 0:
        return tl.load(Keys + key_row * stride_keys + start + j, mask=inside, other=0).to(tl.int64)
    page = tl.load(Keys + key_row * stride_keys + start + j // PAGE, mask=inside, other=0)
    return page.to(tl.int64) * PAGE + j % PAGE


@triton.jit
def _block_slots(Keys, stride_keys, key_row, start, n, offs, inside, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Slots of key block ``n`` (keys ``n * BLOCK_N + offs``) of one row: by page, a block
    inside one page (the region starts on a page boundary) is one page lookup."""
    if PAGE > 0 and PAGE % BLOCK_N == 0:
        page = tl.load(Keys + key_row * stride_keys + start + (n * BLOCK_N) // PAGE)
        return page.to(tl.int64) * PAGE + (n * BLOCK_N) % PAGE + offs
    return _key_slots(Keys, stride_keys, key_row, start, n * BLOCK_N + offs, inside, PAGE)


@triton.jit(do_not_specialize=["hist_cols"])
def _grouped_self_kernel(
    Q, K, V, Out, GroupRows, KvLens, RegionStart, Keys, PoolRows, Hist, HistLens,
    stride_gr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_keys, stride_hist, hist_cols, qk_scale,
    WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """PAGE == 0: ``Keys`` is req_to_token, a row's table row ``PoolRows[b]``; PAGE > 0: the
    batch's page table, row ``b``."""
    kvh = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    group = GroupRows + g * stride_gr
    if tl.load(group) < 0:  # an unused group slot
        return
    r = tl.arange(0, BLOCK_M)
    rows = tl.load(group + r, mask=r < WIDTH, other=-1).to(tl.int64)  # [M] batch rows
    valid = rows >= 0
    tok = tl.where(valid, rows, 0)  # [M] row of q / out
    kv = tl.load(KvLens + tok, mask=valid, other=0).to(tl.int32)  # [M] keys of each row
    prow = tl.load(PoolRows + tok, mask=valid, other=0).to(tl.int64)  # [M] req_to_token rows
    start = tl.load(RegionStart + tok, mask=valid, other=0).to(tl.int64)  # [M]
    key_row = prow if PAGE == 0 else tok  # [M] row of the key table
    shared = _shared_keys(Hist, HistLens, stride_hist, hist_cols, prow, valid, kv, r, BLOCK_T)

    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + kvh * stride_qh + d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0)  # [M, D]
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The shared prefix: the lead's keys [0, shared), one tile for every member.
    lead_row = tl.sum(tl.where(r == 0, key_row, 0), 0)
    lead_start = tl.sum(tl.where(r == 0, start, 0), 0)
    first = tl.zeros([BLOCK_M], dtype=tl.int32)
    lim = tl.where(valid, shared - 1, -1)
    offs = tl.arange(0, BLOCK_N)
    for n in range(0, tl.cdiv(shared, BLOCK_N)):
        j = n * BLOCK_N + offs  # [N]
        kmask = j < shared
        slot = _block_slots(Keys, stride_keys, lead_row, lead_start, n, offs, kmask, PAGE,
                            BLOCK_N)  # [N]
        kT = tl.load(k_base + slot[None, :] * stride_kt + d[:, None],
                     mask=kmask[None, :] & dmask[:, None], other=0.0)  # [D, N]
        v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0)  # [N, D]
        m, lsum, acc = _softmax_step(q, kT, v, j, first, lim, m, lsum, acc, qk_scale,
                                     PRECISION, UPCAST)

    # Each member's own keys [shared, kv_len), laid end to end (member 0's, then member 1's,
    # ...): pair p of the list is key shared + p - off[m] of the member m whose range
    # [off[m], off[m] + own[m]) holds it, so the same tiles serve with per-member ranges.
    own = tl.where(valid, tl.maximum(kv - shared, 0), 0)  # [M]
    end = tl.cumsum(own, 0)  # [M] end of each member's range
    off = end - own
    first = off
    lim = end - 1
    for n in range(0, tl.cdiv(tl.sum(own, 0), BLOCK_N)):
        p = n * BLOCK_N + offs  # [N] pairs
        which = (p[None, :] >= off[:, None]) & (p[None, :] < end[:, None])  # [M, N] one-hot
        inside = tl.max(which.to(tl.int32), 0) > 0  # [N]
        p_row = tl.sum(tl.where(which, key_row[:, None], 0), 0)  # [N] its member's table row
        p_start = tl.sum(tl.where(which, start[:, None], 0), 0)
        p_key = shared + p - tl.sum(tl.where(which, off[:, None], 0), 0)  # [N] key index
        slot = _key_slots(Keys, stride_keys, p_row, p_start, p_key, inside, PAGE)  # [N]
        kT = tl.load(k_base + slot[None, :] * stride_kt + d[:, None],
                     mask=inside[None, :] & dmask[:, None], other=0.0)  # [D, N]
        v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :],
                    mask=inside[:, None] & dmask[None, :], other=0.0)  # [N, D]
        m, lsum, acc = _softmax_step(q, kT, v, p, first, lim, m, lsum, acc, qk_scale,
                                     PRECISION, UPCAST)

    _store_rows(Out, Out, Out, acc, m, lsum, tok, tok * 0 + kvh, valid, d, 0, 0, 0,
                stride_ot, stride_oh, HEAD_DIM, False)


def grouped_self_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           group_rows: torch.Tensor, kv_lens: torch.Tensor,
                           region_start: torch.Tensor, pool_rows: torch.Tensor,
                           history: torch.Tensor, history_lens: torch.Tensor, scale: float, *,
                           req_to_token: torch.Tensor | None = None,
                           page_table: torch.Tensor | None = None, page_size: int = 0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode self-attention reading each row group's shared decoder keys once (module doc).

    q ``[B, H, D]`` (one query per batch row; as many kv heads); k_cache/v_cache ``[num_slots,
    H, D]``; group_rows ``[G <= B, W]``; kv_lens ``[B]`` decoder keys of each row (this step's
    included); region_start ``[B]`` the decoder region's first column (by token) or first page
    (by page); pool_rows ``[B]`` each row's ``req_to_token`` row (its history row too);
    history ``[rows, T]`` / history_lens ``[rows]``: the sampled tokens. Keys by token:
    ``req_to_token``; by page: ``page_table [B, max_pages]`` and ``page_size >= 1``. Rows
    with no key get zeros. Returns ``[B, H, D]`` in q's dtype.
    """
    B, Hq, Hkv, D = check_qkv(q, k_cache, v_cache, out)
    if Hq != Hkv:
        raise ValueError(f"grouped self-attention takes no GQA: {Hq} query heads, {Hkv} kv")
    for name, t in (("kv_lens", kv_lens), ("region_start", region_start),
                    ("pool_rows", pool_rows)):
        if t.shape != (B,):
            raise ValueError(f"{name} must be [B] = [{B}], got {tuple(t.shape)}")
    if group_rows.dim() != 2 or group_rows.shape[0] > max(B, 1):
        raise ValueError(f"need group_rows [G <= {B}, W], got {tuple(group_rows.shape)}")
    if history.dim() != 2 or history_lens.shape != (history.shape[0],):
        raise ValueError(f"need history [rows, T] and history_lens [rows], got "
                         f"{tuple(history.shape)}, {tuple(history_lens.shape)}")
    if (req_to_token is None) == (page_table is None) or (page_table is None) != (page_size == 0) \
            or page_size < 0:
        raise ValueError("give either req_to_token, or page_table and page_size >= 1")
    keys = req_to_token if page_table is None else page_table
    if keys.dim() != 2 or (page_table is not None and keys.shape[0] != B):
        raise ValueError(f"the key table must be 2-D ([B, pages] by page), got "
                         f"{tuple(keys.shape)}")
    tensors = (("group_rows", group_rows), ("kv_lens", kv_lens), ("region_start", region_start),
               ("pool_rows", pool_rows), ("history", history), ("history_lens", history_lens),
               ("key table", keys))
    for name, t in tensors:
        check_index(name, t)
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its columns")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if page_size and k_cache.shape[0] % page_size != 0:
        raise ValueError(f"num_slots {k_cache.shape[0]} is not a multiple of page_size "
                         f"{page_size}")
    if out is None:
        out = torch.empty_like(q)
    if B == 0 or group_rows.shape[0] == 0 or group_rows.shape[1] == 0:
        return out
    width = group_rows.shape[1]
    block_m = max(16, triton.next_power_of_2(width))
    block_d = max(16, triton.next_power_of_2(D))
    block_n, cfg = tile_config(block_m, block_d, q.dtype, BLOCK_N)
    _grouped_self_kernel[(Hkv, group_rows.shape[0])](
        q, k_cache, v_cache, out, group_rows, kv_lens, region_start, keys, pool_rows, history,
        history_lens, group_rows.stride(0), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), history.stride(0), history.shape[1], float(scale) * LOG2E,
        WIDTH=width, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=BLOCK_T,
        HEAD_DIM=D, BLOCK_D=block_d, PAGE=page_size, **cfg)
    return out
