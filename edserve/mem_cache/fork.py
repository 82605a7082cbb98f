"""Shared KV pages across rows: attach a shared prefix, fork a row, copy-on-write.

A row owns whole pages filled from page offset 0 in column order, so column ``c`` sits at page
offset ``c % ps`` and the row's pages are named by the slots at columns ``0, ps, 2ps, ...``.
Sharing a prefix of ``L`` columns shares the pages ``slots[0::ps]`` (each gets one more
holder in the allocator's refcounts); the new holder's row points at the very same slots::

    parent row   | p1 p1 p1 p1 | p2 p2 p2 p2 | p3 p3 .. ..|      page p3 is partial
    child row    | p1 p1 p1 p1 | p2 p2 p2 p2 | p3 p3 |           refcount(p1, p2, p3) == 2

Whole pages are read-only for every holder (nobody writes below its own length), so they stay
shared for good. A shared *partial* last page is the one place two holders could write: the
next write of a holder at column ``L`` lands at offset ``L % ps`` of that page. Before a row's
first write into such a page, ``cow_last_pages`` gives it a fresh page holding a copy of the
filled slots (columns ``L - L % ps .. L-1``), repoints the row and drops its hold on the old
page. Holders that are not listed (e.g. the parent) keep writing in place.

Per encoder-KV strategy (row = ``| encoder KV | pad (aligned) | decoder KV |``):

* ``aligned``: the encoder region is padded to a page multiple, so a fork shares whole
  encoder pages and only the decoder's partial last page is ever copied.
* ``flat`` / ``ragged``: the encoder region may end mid-page (e.g. 1500 % 128 = 92 at page
  size 128) and the first decoder tokens share that page. The first write of a fork (or of a
  request that attached a held encoder region) into it copies that page once (the encoder
  tail plus the decoder tokens so far); later decoder pages are whole and shared as is.

At page size 1 every page is full, so nothing is ever copied. Misuse raises before anything
changes (with the allocator's ``debug`` on for the page checks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.errors import ContextOverflowError, KVCacheError
from edserve.mem_cache.kv_pool import KVPool
from edserve.mem_cache.layout import segment_ids
from edserve.mem_cache.req_to_token import ReqToTokenPool


def _host_list(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [N] on ``device`` from a host list; via pinned memory, so the copy does not
    wait for the device (no sync)."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)


def attach_shared(rtp: ReqToTokenPool, allocator: BaseAllocator, row: int,
                  slots: torch.Tensor) -> None:
    """``req_to_token[row, :L] = slots`` and one more holder on each page ``slots[0::ps]``.

    slots: int [L], a prefix of another holder's row (or a held encoder region), so
    ``slots[0::ps]`` are page starts; L may end mid-page. ``row`` must be held. Sync-free with
    the allocator's ``debug`` off; misuse raises before anything changes.
    """
    if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"attach_shared: slots must be 1-D integer, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    rtp.check_held(row, "attach to")
    if slots.numel() > rtp.max_context_len:
        raise ContextOverflowError(f"attach_shared: {slots.numel()} slots do not fit in "
                                   f"max_context_len={rtp.max_context_len}")
    allocator.share(slots[0::allocator.page_size])  # validates (debug) before it changes
    rtp.write(row, 0, slots)


def fork_row(rtp: ReqToTokenPool, allocator: BaseAllocator, parent_row: int, child_req: Any,
             length: int) -> int | None:
    """Give ``child_req`` (holding no row) a row sharing the parent's first ``length`` columns.

    Returns the child's row, or ``None`` with nothing changed when no row is free. The child
    must call ``cow_last_pages`` before its first write (as must the parent, if listed).
    """
    rtp.check_held(parent_row, "fork")
    if child_req.req_pool_idx is not None:
        raise KVCacheError(f"fork_row: the child already holds row {child_req.req_pool_idx}")
    if not 0 <= length <= rtp.max_context_len:
        raise ContextOverflowError(f"fork_row: length {length} outside 0..{rtp.max_context_len}")
    rows = rtp.alloc([child_req])
    if rows is None:
        return None
    try:
        attach_shared(rtp, allocator, rows[0],
                      rtp.req_to_token[parent_row, :length].to(torch.int64))
    except BaseException:
        rtp.free(child_req)
        raise
    return rows[0]


def row_page_starts(rtp: ReqToTokenPool, rows: Sequence[int], lengths: Sequence[int],
                    page_size: int) -> torch.Tensor:
    """int64 [sum ceil(len / ps)]: the first slot of every page of each row's first
    ``lengths[i]`` columns (columns 0, ps, 2 ps, ...), row after row; one gather, no sync.
    The gather's index is built on the device from one number per row (at page size 1 a
    beam step's rows hold ~1,600 pages each: a host list of them cost ~1 ms per CPU step)."""
    dev = rtp.device
    npages = [-(-n // page_size) for n in lengths]
    width, total = max(npages, default=0), sum(npages)
    if width == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    r = len(rows)
    if total == r * width:  # rows of one length (a beam group's): the whole grid, in order
        idx = _host_list(list(rows), dev)
        firsts = rtp.req_to_token.index_select(0, idx)[:, :width * page_size:page_size]
        return firsts.reshape(-1).to(torch.int64)
    ranks = itertools.accumulate(npages[:-1], initial=0)  # output position of row i's page 0
    offsets = [i * width - rank for i, rank in enumerate(ranks)]
    host = _host_list(list(rows) + npages + offsets, dev)
    counts, base = host[r:2 * r], host[2 * r:]
    # page j of row i sits at i * width + j in the [rows, width] grid; its rank in the output
    # is sum(npages[:i]) + j, so grid position = rank + base[i]
    flat = torch.arange(total, device=dev) + torch.repeat_interleave(base, counts,
                                                                     output_size=total)
    firsts = rtp.req_to_token.index_select(0, host[:r])[:, :width * page_size:page_size]
    return firsts.reshape(-1).index_select(0, flat).to(torch.int64)


def fork_rows(rtp: ReqToTokenPool, allocator: BaseAllocator, parent_rows: Sequence[int],
              children: Sequence[Any], lengths: Sequence[int]) -> list[int] | None:
    """:func:`fork_row` for many children at once (a batch of device ops, no sync).

    ``children[i]`` gets a row sharing the first ``lengths[i]`` columns of ``parent_rows[i]``
    (a parent may be listed several times). Returns the children's rows, or ``None`` with
    nothing changed when rows run short.
    """
    if not len(parent_rows) == len(children) == len(lengths):
        raise ValueError("fork_rows: parent_rows, children and lengths differ in length")
    for row, n in zip(parent_rows, lengths, strict=True):
        rtp.check_held(row, "fork")
        if not 0 <= n <= rtp.max_context_len:
            raise ContextOverflowError(f"fork_rows: length {n} outside 0.."
                                       f"{rtp.max_context_len}")
    if not children:
        return []
    rows = rtp.alloc(children)
    if rows is None:
        return None
    try:
        allocator.share(row_page_starts(rtp, parent_rows, lengths, allocator.page_size))
    except BaseException:
        for c in children:
            rtp.free(c)
        raise
    idx = _host_list(list(parent_rows) + rows, rtp.device)
    n = len(rows)
    rtp.req_to_token[idx[n:]] = rtp.req_to_token.index_select(0, idx[:n])  # whole rows
    return rows


def cow_last_pages(rtp: ReqToTokenPool, allocator: BaseAllocator, kv_pool: KVPool,
                   rows: Sequence[int], lengths: Sequence[int]) -> bool:
    """Copy-on-write: un-share the partial last page of each listed row before it writes.

    rows, lengths: host lists; ``lengths[i]`` is row i's filled columns (its next write goes
    to column ``lengths[i]``). A row needs a copy iff ``length % ps != 0`` and the page holding
    column ``length - 1`` has count c > 1. If k listed rows hold a page with count c, the first
    ``min(k, c - 1)`` of them copy (when every holder is listed, the last keeps the page), so
    after the call no two holders will write the same slot. Each copying row gets a fresh
    page with the K and V (all layers) of columns ``[length - length % ps, length)`` at the same
    offsets, its row repointed, and one hold on the old page dropped (it stays >= 1).

    One host sync (reading the pages and counts). Returns ``False`` with nothing changed when
    free pages run short, ``True`` otherwise.
    """
    ps = allocator.page_size
    if len(rows) != len(lengths):
        raise ValueError(f"cow_last_pages: {len(rows)} rows but {len(lengths)} lengths")
    if len(set(rows)) != len(rows):
        raise ValueError("cow_last_pages: a row is listed twice")
    for r, n in zip(rows, lengths, strict=True):
        rtp.check_held(r, "copy-on-write")
        if not 0 <= n <= rtp.max_context_len:
            raise ContextOverflowError(f"cow_last_pages: length {n} of row {r} outside "
                                       f"0..{rtp.max_context_len}")
    cand = [i for i, n in enumerate(lengths) if n % ps]  # rows whose last page is partial
    if not cand:
        return True  # includes page size 1: no sync
    dev = rtp.device
    rows_c = _host_list([rows[i] for i in cand], dev)  # [C]
    start_c = _host_list([lengths[i] - lengths[i] % ps for i in cand], dev)  # [C] last page
    page_c = torch.div(rtp.req_to_token[rows_c, start_c].to(torch.int64), ps,
                       rounding_mode="floor").to(allocator.device)  # [C]
    count_c = allocator.book.refcount[page_c]  # [C]
    pages_h, counts_h = torch.stack([page_c, count_c.to(torch.int64)]).tolist()  # the one sync

    copy: list[int] = []  # indices into cand, in listed order
    copies_of: dict[int, int] = {}
    for j, (p, c) in enumerate(zip(pages_h, counts_h, strict=True)):
        if c <= 0:
            raise KVCacheError(f"cow_last_pages: row {rows[cand[j]]} points at page {p}, "
                               f"which is not handed out")
        if copies_of.get(p, 0) < c - 1:  # more holders than writers so far: copy
            copies_of[p] = copies_of.get(p, 0) + 1
            copy.append(j)
    if not copy:
        return True
    if len(copy) > allocator.book.free_pages.numel():
        return False
    new_pages = allocator._take_pages(len(copy)).to(dev)  # [K] count 1 each
    sel = _host_list(copy, dev)  # [K]
    filled_h = [lengths[cand[j]] % ps for j in copy]
    filled = _host_list(filled_h, dev)  # [K] slots to copy
    total = sum(filled_h)
    seg = segment_ids(filled, total)  # [T] which copy each slot belongs to
    off = torch.arange(total, device=dev) - (torch.cumsum(filled, 0) - filled)[seg]  # [T]
    old_page = page_c.to(dev)[sel]  # [K]
    src = old_page[seg] * ps + off  # [T] slots in the shared page
    dst = new_pages[seg] * ps + off  # [T] same offsets in the fresh page
    kv_dev = kv_pool.device
    kv_pool.copy_slots(src.to(kv_dev), dst.to(kv_dev))
    rtp.req_to_token[rows_c[sel][seg], start_c[sel][seg] + off] = dst.to(torch.int32)
    # c - copies_of[p] >= 1 for every page, so no old page reaches 0: a plain decrement.
    allocator._add_refs(old_page.to(allocator.device), -1)
    return True
