"""``check_integrity`` of an allocator: free list, free mask, reference counts, holders.

Invariants checked (vectorised: unique / bincount, a few host syncs; for tests and debug)::

    free list   no duplicates, never page 0, pages 1..num_pages, agrees with the free mask
    refcount    page 0 has 0; free pages have 0; every other page >= 1 (else it leaked),
                so free pages + handed-out pages == num_pages
    owned       (one holder set, each slot once) free + owned pages == num_pages, no page both
                free and owned, every owned page has count 1
    holders     (each tensor one holder, holders may overlap) for every page,
                count == number of holders whose slots touch it
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edserve.mem_cache.errors import IntegrityError
from edserve.mem_cache.index_args import as_index, preview
from edserve.mem_cache.layout import segment_ids
from edserve.mem_cache.page_book import PageBook


def check_allocator_integrity(
    book: PageBook,
    owned: torch.Tensor | None = None,
    holders: Sequence[torch.Tensor] | None = None,
) -> None:
    """Raise ``IntegrityError`` naming the offending pages unless every invariant holds."""
    _check_free_list(book)
    _check_counts(book)
    if owned is not None:
        _check_owned(book, as_index(owned, "check_integrity: owned", book.device))
    if holders is not None:
        _check_holders(book, holders)


def _check_free_list(book: PageBook) -> None:
    free = book.free_pages
    if free.numel():
        if bool((free == 0).any()):
            raise IntegrityError("page 0 (padding) is on the free list")
        bad = free[(free < 1) | (free > book.num_pages)]
        if bad.numel():
            raise IntegrityError(f"free list holds pages outside 1..{book.num_pages}: {bad}")
        uniq, counts = torch.unique(free, return_counts=True)
        if uniq.numel() != free.numel():
            raise IntegrityError(f"free list holds pages twice: {preview(uniq[counts > 1])}")
    if int(book.is_free.sum()) != free.numel() or not bool(book.is_free[free].all()):
        raise IntegrityError("free list and free mask disagree")


def _check_counts(book: PageBook) -> None:
    rc, is_free = book.refcount, book.is_free  # [num_pages + 1] each
    if int(rc[0]) != 0:
        raise IntegrityError(f"page 0 (padding) has refcount {int(rc[0])}, expected 0")
    neg = torch.nonzero(rc < 0).reshape(-1)
    if neg.numel():
        raise IntegrityError(f"negative refcounts on pages {preview(neg)}: {preview(rc[neg])}")
    free_ref = torch.nonzero(is_free & (rc != 0)).reshape(-1)
    if free_ref.numel():
        raise IntegrityError(
            f"free pages with nonzero refcount: pages {preview(free_ref)} counts "
            f"{preview(rc[free_ref])}"
        )
    leaked = torch.nonzero(~is_free[1:] & (rc[1:] == 0)).reshape(-1) + 1
    if leaked.numel():
        raise IntegrityError(
            f"{leaked.numel()} leaked pages (count 0 but not on the free list), e.g. "
            f"{preview(leaked)}"
        )


def _check_owned(book: PageBook, own: torch.Tensor) -> None:
    """The single-holder check: ``own`` lists every slot held by requests, each once."""
    ps, free = book.page_size, book.free_pages
    if own.numel():
        uniq, counts = torch.unique(own, return_counts=True)
        if uniq.numel() != own.numel():
            raise IntegrityError(f"slots owned twice: {preview(uniq[counts > 1])}")
        if int(uniq[0]) < ps or int(uniq[-1]) >= (book.num_pages + 1) * ps:
            raise IntegrityError(
                f"owned slots outside the pool's pages 1..{book.num_pages}: min "
                f"{int(uniq[0])} max {int(uniq[-1])}"
            )
    owned_pages = torch.unique(own // ps)
    both = owned_pages[book.is_free[owned_pages]]
    if both.numel():
        raise IntegrityError(f"pages both free and owned: {preview(both)}")
    if free.numel() + owned_pages.numel() != book.num_pages:
        seen = book.is_free.clone()
        seen[owned_pages] = True
        leaked = torch.nonzero(~seen[1:]).reshape(-1) + 1
        raise IntegrityError(
            f"free pages ({free.numel()}) + owned pages ({owned_pages.numel()}) != total "
            f"pages ({book.num_pages}): {leaked.numel()} leaked, e.g. {preview(leaked)}"
        )
    counts = book.refcount[owned_pages]
    shared = owned_pages[counts != 1]
    if shared.numel():
        raise IntegrityError(
            f"owned pages with refcount != 1: pages {preview(shared)} counts "
            f"{preview(book.refcount[shared])} (check shared pages with holders=)"
        )


def _check_holders(book: PageBook, holders: Sequence[torch.Tensor]) -> None:
    """count[p] == #holders touching page p, for every page (0 included)."""
    dev, ps, n = book.device, book.page_size, book.num_pages
    end = (n + 1) * ps
    parts = [as_index(h, f"check_integrity: holders[{i}]", dev) for i, h in enumerate(holders)]
    lens = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)  # [H]
    slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev)  # [S]
    hid = segment_ids(lens, slots.numel())  # [S] holder of each slot
    bad = (slots < ps) | (slots >= end)
    if bool(bad.any()):
        i = int(hid[bad][0])
        raise IntegrityError(
            f"holder {i} lists slots outside the pool's pages 1..{n}: {preview(slots[bad])}"
        )
    key = hid * end + slots  # [S] (holder, slot)
    uniq, counts = torch.unique(key, return_counts=True)
    if uniq.numel() != key.numel():
        dup = uniq[counts > 1]
        raise IntegrityError(
            f"holder {int(dup[0] // end)} lists slots more than once: {preview(dup % end)}"
        )
    held_pages = torch.unique(hid * (n + 1) + slots // ps) % (n + 1)  # one per (holder, page)
    expected = torch.bincount(held_pages, minlength=n + 1)  # [num_pages + 1]
    both = torch.nonzero(book.is_free & (expected > 0)).reshape(-1)
    if both.numel():
        raise IntegrityError(f"pages both free and held: {preview(both)}")
    rc = book.refcount.to(torch.int64)
    wrong = torch.nonzero(rc != expected).reshape(-1)
    if wrong.numel():
        raise IntegrityError(
            f"refcounts disagree with the holders on pages {preview(wrong)}: counts "
            f"{preview(rc[wrong])}, holders {preview(expected[wrong])}"
        )
