"""Turn a list of requests into a :class:`ForwardBatch`: allocate rows and slots, fill
``req_to_token``, and compute the index tensors the attention backend reads.

Prefill (EXTEND) lays each new row out as ``[encoder region | prompt tokens]``; decode takes one
slot per request at column ``enc_region + kv_len``; a mixed step (EXTEND with decoding rows
first) does both in one batch. All leave state untouched and return ``None`` when the pools
run short (the scheduler's back-pressure signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.host_copy import to_device
from edserve.engine.req import Req
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.layers.forward_batch import ForwardBatch, ForwardMode
from edserve.mem_cache import (
    KVPool,
    ReqToTokenPool,
    attach_shared,
    cow_last_pages,
    row_page_starts,
    write_cache_indices,
)


@dataclass
class Pools:
    req_to_token_pool: ReqToTokenPool
    allocator: object  # TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator
    kv_pool: KVPool
    backend: EncoderDecoderBackend
    device: torch.device


def _make_batch(pools: Pools, mode: ForwardMode, reqs: list[Req], q_lens: list[int],
                positions: torch.Tensor | None, out_cache_loc: torch.Tensor,
                encoder_out_cache_loc: torch.Tensor | None) -> ForwardBatch:
    """positions None: one new token per request, at position ``kv_len - 1`` (decode)."""
    B = len(reqs)
    seq = [r.kv_len for r in reqs]
    enc = [r.encoder_len for r in reqs]
    cu = [0] * (B + 1)
    host: list[int] = []  # one host->device copy for every per-request index
    for i, (r, n) in enumerate(zip(reqs, q_lens, strict=True)):
        cu[i + 1] = cu[i] + n
        host += (r.req_pool_idx, seq[i], seq[i] - n, enc[i], r.enc_region)
    ranges = _cross_ranges(reqs, mode, q_lens)
    grouped = mode == ForwardMode.DECODE and ranges is None and pools.backend.grouped_cross
    if grouped:
        host += _cross_groups(reqs)
    on_dev = to_device(host, torch.int64, pools.device)
    cols = on_dev[:5 * B].view(B, 5).t()
    batch = ForwardBatch(
        mode=mode,
        req_pool_indices=cols[0].contiguous(),
        seq_lens=cols[1].contiguous(),
        prefix_lens=cols[2].contiguous(),
        cu_q=to_device(cu, torch.int32, pools.device),
        max_q=max(q_lens),
        positions=cols[1] - 1 if positions is None else positions,
        out_cache_loc=out_cache_loc,
        encoder_lens=cols[3].contiguous(),
        encoder_offsets=cols[4].contiguous(),
        req_to_token=pools.req_to_token_pool.req_to_token,
        kv_pool=pools.kv_pool,
        attn_backend=pools.backend,
        page_size=pools.kv_pool.page_size,
        encoder_out_cache_loc=encoder_out_cache_loc,
        seq_lens_cpu=seq,
        encoder_lens_cpu=enc,
        q_starts_cpu=cu[:-1],
    )
    if ranges is not None:
        batch.cross_kv_ranges = to_device(ranges, torch.int32, pools.device).view(-1, 2)
    elif grouped:
        batch.cross_groups = on_dev[5 * B:].view(B, MAX_GROUP_ROWS)
    elif mode == ForwardMode.DECODE:
        batch.cross_runs = _cross_runs(reqs)
    return batch


def _cross_groups(reqs: list[Req]) -> list[int]:
    """The padded group table ``ForwardBatch.cross_groups`` on the host, flattened
    (``[B * MAX_GROUP_ROWS]``): the rows of each row group in batch order, a row outside any
    group alone, unused groups and slots -1."""
    rows_of: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(reqs):
        key = ("group", r.group.id) if r.group is not None else ("row", i)
        rows_of.setdefault(key, []).append(i)
    width = MAX_GROUP_ROWS
    flat = [-1] * (len(reqs) * width)
    for g, rows in enumerate(rows_of.values()):
        if len(rows) > width:
            raise RuntimeError(f"a row group has {len(rows)} rows in one batch; at most "
                               f"{width} (MAX_GROUP_ROWS) are allowed")
        flat[g * width:g * width + len(rows)] = rows
    return flat


def _cross_runs(reqs: list[Req]) -> list[int] | None:
    """Lengths of the runs of consecutive rows of one row group (host only; see
    ``ForwardBatch.cross_view``), or None when no run is longer than one row."""
    runs: list[int] = []
    for i, r in enumerate(reqs):
        if i and r.group is not None and r.group is reqs[i - 1].group and r.encoder_len:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs if len(runs) < len(reqs) else None


def _cross_ranges(reqs: list[Req], mode: ForwardMode, q_lens: list[int]) -> list[int] | None:
    """Per-token visible encoder key ranges, flattened, if any request restricts them."""
    if all(r.request.cross_kv_ranges is None for r in reqs):
        return None
    flat: list[int] = []
    for r, n in zip(reqs, q_lens, strict=True):
        rng = r.request.cross_kv_ranges or [(0, r.encoder_len)] * len(r.prompt_ids)
        rows = rng[-n:] if mode == ForwardMode.EXTEND else [rng[-1]] * n
        for start, end in rows:
            flat += [start, end]
    return flat


def build_prefill(pools: Pools, reqs: list[Req], decoding: list[Req] | None = None
                  ) -> ForwardBatch | None:
    """Allocate rows + slots for newly admitted requests; None (no change) on shortage.

    A request that reuses a held encoder region (``request.encoder_kv``) starts its row with
    those slots (shared, copy-on-write for a partial last page) and allocates only its prompt.

    ``decoding``: running requests that take their next token in the same forward (a mixed
    step): they come first in the batch, one query each, laid out as in :func:`build_decode`;
    the batch's mode is EXTEND and attention treats every row alike (queries attend causally
    over their row's decoder region, cross-attention over its encoder region).
    """
    decoding = decoding or []
    prefill = _alloc_prefill(pools, reqs)
    if prefill is None:
        return None
    new_locs, enc_locs, positions = prefill
    dec_locs = None
    if decoding:
        dec_locs = _alloc_decode(pools, decoding)
        if dec_locs is None:
            release(pools, reqs)  # the new rows go back whole; they stay queued
            return None
        positions = [r.kv_len - 1 for r in decoding] + positions
    q_lens = [1] * len(decoding) + [len(r.prompt_ids) for r in reqs]
    out = torch.cat([dec_locs, new_locs]) if dec_locs is not None else new_locs
    return _make_batch(pools, ForwardMode.EXTEND, decoding + reqs, q_lens,
                       to_device(positions, torch.int64, pools.device), out, enc_locs)


def _alloc_prefill(pools: Pools, reqs: list[Req]
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """Rows and slots for new requests: (decoder slots [T_new] int64, encoder slots
    [sum encoder_lens of the rows whose encoder runs] int64, decoder positions [T_new]), or
    None (no change) on shortage."""
    rtp, alloc, dev = pools.req_to_token_pool, pools.allocator, pools.device
    if rtp.alloc(reqs) is None:
        return None
    B = len(reqs)
    reuse = [r for r in reqs if r.request.encoder_kv is not None]
    prefix_lens = [r.enc_region if r.request.encoder_kv is not None else 0 for r in reqs]
    row_lens = [r.enc_region + len(r.prompt_ids) for r in reqs]
    host = [r.req_pool_idx for r in reqs] + row_lens + prefix_lens
    rows, lens, prefix = to_device(host, torch.int64, dev).view(3, B)
    for r in reuse:
        attach_shared(rtp, alloc, r.req_pool_idx, r.request.encoder_kv.slots)
    if reuse and not cow_last_pages(rtp, alloc, pools.kv_pool, [r.req_pool_idx for r in reuse],
                                    [r.enc_region for r in reuse]):
        _undo_prefill(pools, reqs, reuse)
        return None
    last = torch.where(prefix > 0, rtp.req_to_token[rows, (prefix - 1).clamp(min=0)].long(),
                       -torch.ones_like(prefix))
    num_new = sum(row_lens) - sum(prefix_lens)
    slots = alloc.alloc_extend(prefix, lens, last, num_new, seq_lens_cpu=row_lens,
                               prefix_lens_cpu=prefix_lens)
    if slots is None:
        _undo_prefill(pools, reqs, reuse)
        return None
    prefixes = [rtp.req_to_token[r.req_pool_idx, :p].long() for r, p in zip(reqs, prefix_lens,
                                                                          strict=True)]
    write_cache_indices(rtp.req_to_token, rows, prefix, lens, prefixes, slots,
                        validate=alloc.debug)
    dec_locs, enc_locs, positions = [], [], []
    start = 0
    for r, n, p in zip(reqs, row_lens, prefix_lens, strict=True):
        if p == 0:  # the encoder runs for this request: its cross K/V go to these slots
            enc_locs.append(slots[start:start + r.encoder_len])
        dec_locs.append(slots[start + r.enc_region - p:start + n - p])
        positions += range(len(r.prompt_ids))
        r.kv_len = len(r.prompt_ids)
        start += n - p
    return torch.cat(dec_locs), torch.cat(enc_locs) if enc_locs else slots[:0], positions


def _undo_prefill(pools: Pools, reqs: list[Req], reuse: list[Req]) -> None:
    """Shortage after rows were taken: drop the shared prefixes, hand the rows back."""
    alloc, rtp = pools.allocator, pools.req_to_token_pool
    if reuse:
        alloc.free_page_starts(row_page_starts(rtp, [r.req_pool_idx for r in reuse],
                                               [r.enc_region for r in reuse], alloc.page_size),
                               shared=True)
    for r in reqs:
        rtp.free(r)


def build_decode(pools: Pools, reqs: list[Req]) -> ForwardBatch | None:
    """One new slot per running request at column ``row_len``; None (no change) on shortage."""
    locs = _alloc_decode(pools, reqs)
    if locs is None:
        return None
    return _make_batch(pools, ForwardMode.DECODE, reqs, [1] * len(reqs), None, locs, None)


def _alloc_decode(pools: Pools, reqs: list[Req]) -> torch.Tensor | None:
    """The slot of each running request's next token ([B] int64, written at column
    ``row_len``; ``kv_len`` advances), or None on shortage."""
    rtp, dev = pools.req_to_token_pool, pools.device
    B = len(reqs)
    cols_host = [r.row_len for r in reqs]  # column of each new token
    if max(cols_host) >= rtp.max_context_len:
        raise RuntimeError("decode step past max_context_len (scheduler limit violated)")
    forks = [r for r in reqs if r.cow_pending]
    if forks:  # a fork's first write: copy its shared partial last page (if still shared)
        if not cow_last_pages(rtp, pools.allocator, pools.kv_pool,
                              [r.req_pool_idx for r in forks], [r.row_len for r in forks]):
            return None
        for r in forks:
            r.cow_pending = False
    rows, cols = to_device([r.req_pool_idx for r in reqs] + cols_host, torch.int64,
                           dev).view(2, B)
    last_loc = rtp.req_to_token[rows, cols - 1].long()
    locs = pools.allocator.alloc_decode(cols + 1, last_loc,
                                        seq_lens_cpu=[c + 1 for c in cols_host])
    if locs is None:
        return None
    rtp.req_to_token[rows, cols] = locs.to(torch.int32)
    for r in reqs:
        r.kv_len += 1
    return locs.long()


def release(pools: Pools, reqs: list[Req]) -> None:
    """Return the rows and KV pages of finished/aborted requests (one grouped free).

    A row owns whole pages filled from offset 0 in column order, so its pages are named by
    the slots in columns ``0, ps, 2 ps, ...`` below ``row_len`` (one gather for all rows).
    Rows that may share pages (row groups, reused encoder regions) drop one reference per page
    (one sync per free group); the others free without a sync."""
    holding = [r for r in reqs if r.req_pool_idx is not None]
    if not holding:
        return
    alloc, rtp = pools.allocator, pools.req_to_token_pool
    own_group = not alloc.in_free_group  # a caller's open group releases for us
    if own_group:
        alloc.free_group_begin()
    try:
        for shared in (False, True):
            part = [r for r in holding if r.shares_pages == shared and r.row_len > 0]
            if part:
                alloc.free_page_starts(row_page_starts(
                    rtp, [r.req_pool_idx for r in part], [r.row_len for r in part],
                    alloc.page_size), shared=shared)
    finally:
        if own_group:
            alloc.free_group_end()
    for r in holding:
        rtp.free(r)
        r.kv_len = 0
