"""Rows that take another row's sequence, as device index ops (beam reorders, no host read).

A beam group decoded on fixed rows (one per beam slot, all at the same length) rearranges after
every step: row ``rows[i]`` continues the sequence of row ``parents[i]``
(:class:`~edserve.engine.beam_device.BeamChoice` gives the parents). :func:`reorder_rows`
makes each row *read* its parent's KV without moving whole pages' contents::

    parent row   | e1 e1 | e2 e2 | d1 d1 | p4 p4 ..|        p4: the parent's partial last page
    row before   | e1 e1 | e2 e2 | x1 x1 | t4 t4 ..|        t4: the row's own partial page
    row after    | e1 e1 | e2 e2 | d1 d1 | t4 t4 ..|        t4 now holds a copy of p4's slots

- columns below ``length - length % ps`` (whole pages) point at the parent's pages: whole
  pages are never written again, so rows may share them for good (page-table entries only);
- the columns of the partial last page keep the row's *own* page, and the K/V of its decoder
  slots (columns ``max(full, dec_start) .. length - 1``) are copied from the parent's page,
  so the next token of each row is written into a page no other row reads.

Invariant the caller keeps (it holds for rows that each allocated their own tail page): a
row's partial last page is its own (no other row's table names it). Pages stay where their
allocator accounting puts them: a page a row allocated belongs to that row until its group
ends, whichever rows' tables name it (the group frees its rows' *own* pages at the end), so a
reorder changes no reference count and never frees or takes a page: nothing the host must
learn. Every index has a fixed shape (``[N, page_size - 1]`` tail copies, padding ``0 -> 0``
for the unused ones, which the pool's copy kernel skips), so the op is sync-free and can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.fork import _host_list
from edserve.mem_cache.kv_pool import KVPool


def reorder_rows(req_to_token: torch.Tensor, kv_pool: KVPool, rows: torch.Tensor,
                 parents: torch.Tensor, lengths: torch.Tensor, dec_start: torch.Tensor) -> None:
    """Row ``rows[i]`` takes the first ``lengths[i]`` columns of row ``parents[i]`` (see the
    module doc); a row listed as its own parent is left as it is.

    req_to_token: [rows + 1, C] int32 page tables (updated in place);
    rows, parents: [N] int64 (a parent may be listed many times; page-table reads happen
    before any write, but the K/V copies need a moved row not to be another moved row's
    parent: ``kv_pool.copy_slots`` pairs must not overlap. Beam choice keeps this: a beam's
    source keeps its slot, only forks move); lengths: [N] int64 filled columns (equal
    for a row and its parent); dec_start: [N] int64 first decoder column (the encoder region's
    columns are equal in both rows and are never copied). Sync-free.
    """
    ps = kv_pool.page_size
    C = req_to_token.shape[1]
    dev = req_to_token.device
    moved = parents != rows  # [N]
    old = req_to_token.index_select(0, rows)  # [N, C]
    par = req_to_token.index_select(0, parents)  # [N, C]
    full = lengths - lengths % ps  # [N] columns on whole pages
    col = torch.arange(C, device=dev)
    take = moved[:, None] & (col[None, :] < full[:, None])  # [N, C]
    new = torch.where(take, par, old)
    if ps > 1:  # the partial last page: copy the parent's decoder slots into the row's page
        tail = full[:, None] + torch.arange(ps - 1, device=dev)[None, :]  # [N, ps - 1]
        copy = moved[:, None] & (tail < lengths[:, None]) & (tail >= dec_start[:, None])
        tail = tail.clamp(max=C - 1)
        src = torch.where(copy, par.gather(1, tail), 0).reshape(-1).long()  # 0: padding
        dst = torch.where(copy, old.gather(1, tail), 0).reshape(-1).long()
        kv_pool.copy_slots(src.to(kv_pool.device), dst.to(kv_pool.device))
    req_to_token.index_copy_(0, rows, new)


def private_tails(req_to_token: torch.Tensor, allocator: BaseAllocator, rows: list[int],
                  lengths: list[int]) -> None:
    """Rows that share every page of ``lengths[i]`` columns (``fork_rows``) each take a fresh
    page for the partial last page: its columns ``full .. length - 1`` point at the same
    offsets of the new page, and the shared page loses this row's hold. No K/V is copied:
    the page is filled by :func:`reorder_rows` after the forward that writes the shared one
    (call it with ``dec_start = full`` then). Counts are host-known: sync-free. The caller has
    reserved the pages (admission), so a shortage raises."""
    ps = allocator.page_size
    need = [(r, n) for r, n in zip(rows, lengths, strict=True) if n % ps]
    if not need:
        return
    if len(need) > allocator.book.free_pages.numel():
        raise RuntimeError("private_tails: no free page (reservation violated)")
    dev = req_to_token.device
    new = allocator._take_pages(len(need)).to(dev)  # [K] count 1 each
    rn = _host_list([x for x, _ in need] + [x for _, x in need], dev)
    r, n = rn[:len(need)], rn[len(need):]  # [K] rows, lengths
    full = n - n % ps
    old_page = torch.div(req_to_token[r, full].long(), ps, rounding_mode="floor")
    allocator._add_refs(old_page.to(allocator.device), -1)  # the forker keeps its hold
    off = torch.arange(ps, device=dev)[None, :]  # [1, ps]
    cols = (full[:, None] + off).clamp(max=req_to_token.shape[1] - 1)  # [K, ps]
    inside = full[:, None] + off < n[:, None]
    cur = req_to_token[r[:, None], cols]
    req_to_token[r[:, None], cols] = torch.where(inside, (new[:, None] * ps + off).to(cur.dtype),
                                                 cur)
