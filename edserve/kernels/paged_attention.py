"""Triton paged attention: keys read through a page table, page by page.

Same contract as :func:`edserve.layers.attention.torch_ops.paged_attention`: key ``j`` of request
``b`` lives at slot ``page_table[b, kv_start_page[b] + j // page_size] * page_size
+ j % page_size``. A loop step covers ``BLOCK_N`` keys (``common.tile_config``): one page, an
aligned slice of one large page, or several whole pages when pages are small (< 64 slots, so tiny
pages do not starve the loop). A step must hold whole pages or part of one, so page sizes are
powers of two, and >= 16 (the ``tl.dot`` minimum, like kernels that read one page per step):
``SUPPORTED_PAGE_SIZES``. A backend that must mimic a narrower kernel (Intel XPU flash
attention: 64 or 128) passes ``restrict`` to :func:`check_page_size`.

Grid: (request, kv head, q block x kv split). All ``Hq // Hkv`` query heads of a kv head share
each loaded page (GQA). Decode batches that underfill the GPU split the key range
(flash-decoding) and merge partial results in a second kernel. No host syncs: ``max_q`` is a
Python int and every launch shape comes from tensor shapes.
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

SUPPORTED_PAGE_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
MIN_BLOCK_N = 64  # pages smaller than this are read several per step
# Decode self-attention of one-query rows without GQA (Whisper's decoder): key blocks of 64
# and 2 warps, whatever the page size. H200, large-v3 shapes, histories of 4..104 keys in
# 128-slot pages, one layer (benchmarks/self_attn_decode_gpu.py, wave 26): 320 rows 68.7 ->
# 49.3 us (the flat kernel: 49.0), 64 rows 21.4 -> 16.2 (within that size's noise). Other
# shapes keep tile_config's choice until measured.
DECODE_TILES = (64, 2)


def supported_page_sizes(restrict: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Page sizes this kernel accepts, optionally narrowed to ``restrict`` (e.g. ``(64, 128)``
    to reproduce Intel XPU flash attention). Raises ValueError if ``restrict`` names a size the
    kernel cannot run."""
    if restrict is None:
        return SUPPORTED_PAGE_SIZES
    bad = [p for p in restrict if p not in SUPPORTED_PAGE_SIZES]
    if bad or not restrict:
        raise ValueError(f"restrict={tuple(restrict)} must be a non-empty subset of the paged "
                         f"kernel's page sizes {SUPPORTED_PAGE_SIZES}")
    return tuple(sorted(set(restrict)))


def check_page_size(page_size: int, restrict: tuple[int, ...] | None = None) -> None:
    """Raise ValueError unless ``page_size`` is supported (see :func:`supported_page_sizes`)."""
    ok = supported_page_sizes(restrict)
    if page_size not in ok:
        raise ValueError(f"page size {page_size} is not supported by the paged attention kernel "
                         f"(supported: {ok}); use the flat or ragged encoder-KV strategy, or one "
                         f"of the supported page sizes")


# Batch-dependent scalars are not specialised, so new batch sizes reuse the compiled kernel.
@triton.jit(do_not_specialize=["num_tokens", "NUM_SPLITS"])
def _paged_attn_kernel(
    Q, K, V, Out, PartO, PartLse, KvRanges, PageTable, StartPage, KvLens, CuQ,
    stride_rg, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_pt, qk_scale, num_tokens, num_q_heads, NUM_SPLITS,
    G: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_RANGES: tl.constexpr, IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # BLOCK_N and PAGE are powers of two: a key block is whole pages or a slice of one page.
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
    pt_row = PageTable + b.to(tl.int64) * stride_pt + tl.load(StartPage + b)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    offs = tl.arange(0, BLOCK_N)

    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n in range(lo, hi):
        j = n * BLOCK_N + offs  # [BLOCK_N] key positions
        if BLOCK_N > PAGE:  # small pages: BLOCK_N // PAGE whole pages per step
            page = tl.load(pt_row + j // PAGE, mask=j < kv_end, other=0).to(tl.int64)
            slot = page * PAGE + j % PAGE  # [BLOCK_N]
        else:  # one page, or an aligned slice of one page, per step
            page = tl.load(pt_row + (n * BLOCK_N) // PAGE).to(tl.int64)
            slot = page * PAGE + (n * BLOCK_N) % PAGE + offs  # [BLOCK_N] contiguous slots
        kmask = j < kv_end
        m, lsum, acc = _attend_block(q, k_base, v_base, slot, kmask, d, dmask, stride_kt,
                                     stride_vt, j, first, lim, m, lsum, acc, qk_scale,
                                     PRECISION, UPCAST)

    _store_rows(Out, PartO, PartLse, acc, m, lsum, tok, hq, row_valid, d, split, num_tokens,
                num_q_heads, stride_ot, stride_oh, HEAD_DIM, IS_SPLIT)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, kv_start_page: torch.Tensor,
                    kv_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int, causal: bool,
                    scale: float, page_size: int, kv_ranges: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Paged attention; semantics of ``torch_ops.paged_attention``.

    q ``[T, Hq, D]``; k_cache/v_cache ``[num_slots, Hkv, D]`` (num_slots % page_size == 0);
    page_table ``[B, max_pages]``; kv_start_page, kv_lens ``[B]``; cu_q ``[B+1]`` (int32 or
    int64). ``max_q`` must be >= every request's query count and ``cu_q`` must partition
    ``[0, T)``. ``kv_ranges`` ``[T, 2]`` optionally restricts query t to keys
    ``start <= j < end`` (as in torch_ops). ``out`` (optional, like q) receives the result;
    ``num_splits`` forces the split-KV factor (None: automatic from shapes; 1: never split).
    Returns ``[T, Hq, D]`` in q's dtype.
    """
    check_page_size(page_size)
    T, Hq, Hkv, D, B = check_common(q, k_cache, v_cache, kv_lens, cu_q, max_q, kv_ranges,
                                   out)
    if page_table.dim() != 2 or page_table.shape[0] != B or kv_start_page.shape != (B,):
        raise ValueError(f"need page_table [B, max_pages] and kv_start_page [B] with B={B}; got "
                         f"{tuple(page_table.shape)}, {tuple(kv_start_page.shape)}")
    check_index("page_table", page_table)
    check_index("kv_start_page", kv_start_page)
    if k_cache.shape[0] % page_size != 0:
        raise ValueError(f"num_slots {k_cache.shape[0]} is not a multiple of page_size "
                         f"{page_size}")
    if page_table.device != q.device or kv_start_page.device != q.device:
        raise ValueError("page_table and kv_start_page must be on q's device")
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
    decode = bool(causal) and G == 1 and block_m == 16 and q.dtype != torch.float32
    want_n = DECODE_TILES[0] if decode else max(page_size, MIN_BLOCK_N)
    block_n, cfg = tile_config(block_m, block_d, q.dtype, want_n)
    if decode:
        cfg = dict(cfg, num_warps=DECODE_TILES[1])
    if num_splits is None:
        num_splits = choose_num_splits(B * Hkv * n_qblk, page_table.shape[1] * page_size,
                                       block_n, q.device, bool(causal))
    num_splits = max(1, int(num_splits))
    part_o = part_lse = out  # unused placeholders when not splitting
    rng = kv_ranges if kv_ranges is not None else cu_q  # placeholder without ranges
    if num_splits > 1:
        part_o, part_lse = split_workspaces(num_splits, T, Hq, D, q.device)
    _paged_attn_kernel[(B, Hkv, n_qblk * num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, rng, page_table, kv_start_page, kv_lens, cu_q,
        rng.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        float(scale) * LOG2E, T, Hq, num_splits,
        G=G, QPB=qpb, BLOCK_M=block_m, PAGE=page_size, BLOCK_N=block_n, HEAD_DIM=D,
        BLOCK_D=block_d, CAUSAL=bool(causal), HAS_RANGES=kv_ranges is not None,
        IS_SPLIT=num_splits > 1, **cfg)
    if num_splits > 1:
        combine_splits(part_o, part_lse, out)
    return out
