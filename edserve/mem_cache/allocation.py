"""Rows + slots for an extend batch, and writing them into ``req_to_token``.

After ``write_cache_indices`` the row of request i reads::

    req_to_token[row_i, 0 : prefix_len_i]        = prefix_tensors[i]       (reused slots)
    req_to_token[row_i, prefix_len_i : seq_len_i] = out_cache_loc[e_i : e_i + new_i]

with ``new_i = seq_len_i - prefix_len_i`` and ``e_i`` the sum of the earlier requests'
``new_j``. Columns past ``seq_len_i`` are left alone. Two implementations write identical
rows: a Triton kernel (one program per request, default on CUDA) and a vectorised torch
fallback. Validation costs one host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.errors import (
    ContextOverflowError,
    IndexOutOfRangeError,
    ReservedSlotError,
)
from edserve.mem_cache.layout import segment_ids
from edserve.mem_cache.req_to_token import ReqToTokenPool


class _Batch(NamedTuple):
    prefix: torch.Tensor  # [B] int64
    seq: torch.Tensor  # [B] int64
    prefix_data: torch.Tensor  # [sum prefix] int64: prefixes concatenated
    prefix_starts: torch.Tensor  # [B] int64: offset of request i's prefix in prefix_data
    num_new: int  # sum(seq - prefix): new tokens in the batch


def _index(t: Any, name: str, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _check_batch(
    req_to_token: torch.Tensor,
    prefix_lens: Any,
    seq_lens: Any,
    prefix_tensors: Sequence[torch.Tensor],
    num_new: int | None = None,
    rows: torch.Tensor | None = None,
) -> _Batch:
    """Validate lengths (and ``rows`` if given) with one host sync, and concatenate the
    prefixes; never mutates."""
    device = req_to_token.device
    num_rows, num_cols = req_to_token.shape
    prefix = _index(prefix_lens, "prefix_lens", device)
    seq = _index(seq_lens, "seq_lens", device)
    bs = seq.numel()
    if (
        prefix.numel() != bs
        or len(prefix_tensors) != bs
        or (rows is not None and rows.numel() != bs)
    ):
        raise ValueError(
            f"batch size mismatch: prefix_lens {prefix.numel()}, seq_lens {bs}, prefix_tensors "
            f"{len(prefix_tensors)}"
            + ("" if rows is None else f", req_pool_indices {rows.numel()}")
        )
    given = torch.tensor([p.numel() for p in prefix_tensors], dtype=torch.int64).to(device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    sorted_rows = (rows if rows is not None and bs else zero.new_ones(1)).sort().values
    stats = torch.stack(
        [
            seq.max() if bs else zero,
            ((prefix < 0) | (seq < prefix)).sum(),
            (given != prefix).sum(),
            (seq - prefix).sum(),
            sorted_rows[0],
            sorted_rows[-1],
            (sorted_rows.diff() == 0).sum(),
        ]
    )
    max_seq, n_neg, n_mismatch, total_new, lo, hi, dups = stats.tolist()  # the one sync
    if rows is not None and bs:
        if lo < 0 or hi >= num_rows:
            raise IndexOutOfRangeError(
                f"req_pool_indices must be in 1..{num_rows - 1}, got {lo}..{hi}"
            )
        if lo == 0:
            raise ReservedSlotError("req_pool_indices contains row 0 (the padding row)")
        if dups:
            raise ValueError("req_pool_indices lists a row twice")
    if n_neg:
        raise ValueError("every request needs 0 <= prefix_len <= seq_len")
    if n_mismatch:
        i = int(torch.nonzero(given != prefix)[0])
        raise ValueError(
            f"request {i}: prefix_tensors[{i}] has {int(given[i])} slots but prefix_len is "
            f"{int(prefix[i])}"
        )
    if max_seq > num_cols:
        raise ContextOverflowError(
            f"seq_len {max_seq} does not fit in req_to_token's {num_cols} columns (max_context_len)"
        )
    if num_new is not None and total_new != num_new:
        raise ValueError(
            f"out_cache_loc has {num_new} slots, sum(seq_lens - prefix_lens) = {total_new}"
        )
    parts = [p.reshape(-1).to(device=device, dtype=torch.int64) for p in prefix_tensors]
    prefix_data = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    return _Batch(prefix, seq, prefix_data, _exclusive_cumsum(prefix), int(total_new))


def _resolve_use_triton(use_triton: bool | None, device: torch.device) -> bool:
    if use_triton is not None:
        return use_triton
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _write(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    batch: _Batch,
    out_cache_loc: torch.Tensor,
    use_triton: bool,
) -> None:
    """Write validated rows. rows: [B] int64; out_cache_loc: [sum new] int64 (same device)."""
    prefix, seq, prefix_data, prefix_starts, _ = batch
    ext = seq - prefix  # [B]
    extend_starts = _exclusive_cumsum(ext)
    if use_triton:
        from edserve.kernels.write_req_to_token import write_req_to_token_triton

        pad = torch.zeros(1, dtype=torch.int64, device=rows.device)  # kernels need a pointer
        write_req_to_token_triton(
            req_to_token,
            rows,
            prefix,
            seq,
            prefix_starts,
            prefix_data if prefix_data.numel() else pad,
            extend_starts,
            out_cache_loc if out_cache_loc.numel() else pad,
        )
        return
    num_prefix, num_new = prefix_data.numel(), out_cache_loc.numel()
    if num_prefix:
        seg = segment_ids(prefix, num_prefix)  # [P] request of each prefix slot
        r = rows[seg]
        c = torch.arange(num_prefix, device=rows.device) - prefix_starts[seg]  # [P] column
        req_to_token[r, c] = prefix_data.to(torch.int32)
    if num_new:
        seg = segment_ids(ext, num_new)  # [T] request of each new slot
        r = rows[seg]
        c = torch.arange(num_new, device=rows.device) + (prefix - extend_starts)[seg]  # column
        req_to_token[r, c] = out_cache_loc.to(torch.int32)


def write_cache_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_tensors: list[torch.Tensor],
    out_cache_loc: torch.Tensor,
    use_triton: bool | None = None,
    validate: bool = True,
) -> None:
    """Fill each request's row as ``[prefix slots | new slots]`` (see the module docstring).

    req_to_token: int32 [rows, cols]; req_pool_indices, prefix_lens, seq_lens: [B];
    prefix_tensors[i]: [prefix_lens[i]]; out_cache_loc: [sum(seq_lens - prefix_lens)].
    ``use_triton=None`` picks Triton on CUDA, torch otherwise. Raises
    ``ContextOverflowError`` if a seq_len exceeds the columns; nothing is written on error.
    ``validate=False`` skips the checks and their host sync (the engine's hot path, whose
    lengths come from its own bookkeeping).
    """
    dev = req_to_token.device
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError("req_to_token must be a 2-D int32 tensor")
    rows = _index(req_pool_indices, "req_pool_indices", dev)
    loc = _index(out_cache_loc, "out_cache_loc", dev)
    if validate:
        batch = _check_batch(
            req_to_token, prefix_lens, seq_lens, prefix_tensors, num_new=loc.numel(), rows=rows
        )
    else:
        prefix, seq = _index(prefix_lens, "prefix_lens", dev), _index(seq_lens, "seq_lens", dev)
        parts = [p.reshape(-1).to(device=dev, dtype=torch.int64) for p in prefix_tensors]
        data = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev)
        batch = _Batch(prefix, seq, data, _exclusive_cumsum(prefix), loc.numel())
    _write(req_to_token, rows, batch, loc, _resolve_use_triton(use_triton, dev))


def alloc_for_extend(
    req_to_token_pool: ReqToTokenPool,
    allocator: BaseAllocator,
    reqs: Sequence[Any],
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_tensors: list[torch.Tensor],
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Allocate rows and slots for an extend batch and write the rows.

    Requests that already hold a row keep it (chunked prefill: pass the row's first
    ``prefix_len`` slots as its prefix). Returns ``(rows [B] int64, out_cache_loc [sum new]
    int64)``, or ``None`` when rows or slots run short; then nothing is left allocated (rows
    taken for this call are handed back). Misuse raises before anything changes.
    """
    dev = req_to_token_pool.req_to_token.device
    batch = _check_batch(req_to_token_pool.req_to_token, prefix_lens, seq_lens, prefix_tensors)
    if len(reqs) != batch.seq.numel():
        raise ValueError(f"{len(reqs)} requests but {batch.seq.numel()} seq_lens")
    fresh = [r for r in reqs if r.req_pool_idx is None]
    row_list = req_to_token_pool.alloc(reqs)
    if row_list is None:
        return None
    try:
        prefix, seq, prefix_data, prefix_starts, num_new = batch
        last = torch.full_like(prefix, -1)  # [B] slot of position prefix-1, -1 if none
        if prefix_data.numel():
            tail = prefix_data[(prefix_starts + prefix - 1).clamp(min=0)]
            last = torch.where(prefix > 0, tail, last)
        out = allocator.alloc_extend(prefix, seq, last, num_new)
    except BaseException:
        for r in reversed(fresh):
            req_to_token_pool.free(r)
        raise
    if out is None:
        for r in reversed(fresh):  # reverse order restores the LIFO stack exactly
            req_to_token_pool.free(r)
        return None
    rows = torch.tensor(row_list, dtype=torch.int64, device=dev)
    use = _resolve_use_triton(use_triton, dev)
    _write(req_to_token_pool.req_to_token, rows, batch, out.to(dev), use)
    return rows, out
