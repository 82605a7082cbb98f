"""Triton kernel: write ``[prefix slots | new slots]`` into request rows of ``req_to_token``.

One program per request; no host syncs. Prefixes arrive concatenated (``prefix_data``) with
per-request start offsets, so no pointer arrays are needed. Uses only long-stable
``triton.language`` ops so it compiles on real GPUs and runs under ``TRITON_INTERPRET=1``.
Callers validate shapes and lengths (see ``edserve.mem_cache.allocation``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_req_to_token_kernel(
    req_to_token_ptr,  # int32 [rows, cols]
    row_stride,
    req_pool_indices_ptr,  # int64 [B]
    prefix_lens_ptr,  # int64 [B]
    seq_lens_ptr,  # int64 [B]
    prefix_starts_ptr,  # int64 [B]: offset of request i's prefix in prefix_data
    prefix_data_ptr,  # int64 [sum prefix_lens] (at least 1 element)
    extend_starts_ptr,  # int64 [B]: offset of request i's new slots in out_cache_loc
    out_cache_loc_ptr,  # int64 [sum (seq_lens - prefix_lens)] (at least 1 element)
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    prefix_len = tl.load(prefix_lens_ptr + pid).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + pid).to(tl.int64)
    prefix_start = tl.load(prefix_starts_ptr + pid).to(tl.int64)
    extend_start = tl.load(extend_starts_ptr + pid).to(tl.int64)
    row_ptr = req_to_token_ptr + row * row_stride
    offs = tl.arange(0, BLOCK)

    # columns 0 .. prefix_len-1: the reused prefix slots
    for i in range(0, (prefix_len + BLOCK - 1) // BLOCK):
        cols = i * BLOCK + offs
        mask = cols < prefix_len
        val = tl.load(prefix_data_ptr + prefix_start + cols, mask=mask, other=0)
        tl.store(row_ptr + cols, val.to(tl.int32), mask=mask)

    # columns prefix_len .. seq_len-1: the freshly allocated slots
    extend_len = seq_len - prefix_len
    for i in range(0, (extend_len + BLOCK - 1) // BLOCK):
        cols = i * BLOCK + offs
        mask = cols < extend_len
        val = tl.load(out_cache_loc_ptr + extend_start + cols, mask=mask, other=0)
        tl.store(row_ptr + prefix_len + cols, val.to(tl.int32), mask=mask)


def write_req_to_token_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_starts: torch.Tensor,
    prefix_data: torch.Tensor,
    extend_starts: torch.Tensor,
    out_cache_loc: torch.Tensor,
    block: int = 512,
) -> None:
    """Launch one program per request. All index tensors int64 on ``req_to_token``'s device;
    ``prefix_data`` and ``out_cache_loc`` must hold at least one element (pad if empty)."""
    bs = req_pool_indices.numel()
    if bs == 0:
        return
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    _write_req_to_token_kernel[(bs,)](
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        prefix_lens,
        seq_lens,
        prefix_starts,
        prefix_data,
        extend_starts,
        out_cache_loc,
        BLOCK=block,
    )
