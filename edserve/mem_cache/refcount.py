"""Page reference counts: argument checks for ``share`` / ``free*`` and zero detection.

Every handed-out page carries a reference count (``BaseAllocator._refcount``, int32
``[num_pages + 1]``): the number of holders (request rows, held encoder regions) whose slots
touch the page. ``alloc*`` hands a page out at count 1, ``share`` adds holders, and the frees
drop them; a page goes back to the free list exactly when its count reaches 0. Page 0 and free
pages have count 0. A page whose count reached 0 inside an open free group is *pending*: count
0 but not yet on the free list (``_is_free`` False) until ``free_group_end``.

The checks here read the device once (one host sync) and never mutate; callers run them only
when they are allowed to sync (``free``) or when ``debug`` is on (``share``,
``free_page_starts``).
"""

from __future__ import annotations

import torch

from edserve.mem_cache.errors import (
    AlignmentError,
    DoubleFreeError,
    IndexOutOfRangeError,
    RefcountError,
    ReservedSlotError,
)
from edserve.mem_cache.index_args import preview
from edserve.mem_cache.page_book import PageBook


def validate_free(book: PageBook, idx: torch.Tensor) -> torch.Tensor:
    """Distinct pages (sorted, int64) of the slots ``idx`` [N] for ``free``, or raise.

    Rules: every slot in range and off page 0; no slot listed twice; each page's first slot
    listed (paged: a partial-page free would release tokens the caller did not list); every
    page referenced (count > 0, so neither free nor pending). Never mutates.
    """
    ps = book.page_size
    end = (book.num_pages + 1) * ps
    lo, hi = torch.stack([idx.min(), idx.max()]).tolist()
    if lo < 0 or hi >= end:
        bad = idx[(idx < 0) | (idx >= end)]
        raise IndexOutOfRangeError(f"free: slots {preview(bad)} outside 0..{end - 1}")
    if lo < ps:
        what = "slot 0" if ps == 1 else f"page 0 (slots 0..{ps - 1})"
        raise ReservedSlotError(f"free: {what} is padding and is never handed out")
    uniq, counts = torch.unique(idx, return_counts=True)  # sorted
    if uniq.numel() != idx.numel():
        raise DoubleFreeError(f"free: slots listed more than once: {preview(uniq[counts > 1])}")
    pages = torch.unique_consecutive(uniq // ps)
    if ps > 1:
        starts = uniq[uniq % ps == 0] // ps
        if starts.numel() != pages.numel():
            missing = pages[~torch.isin(pages, starts)]
            raise AlignmentError(
                f"free: partial-page free of pages {preview(missing)}: their first slot is "
                f"not listed, so freeing them would release tokens the caller did not list"
            )
    dead = book.refcount[pages] == 0
    if bool(dead.any()):
        raise DoubleFreeError(f"free: pages already free: {preview(pages[dead])}")
    return pages


def check_page_refs(book: PageBook, idx: torch.Tensor, what: str,
                    exclusive: bool) -> None:
    """Raise unless every slot of ``idx`` [N] starts a referenced page (one host sync).

    ``what``: the caller's name, for messages. ``exclusive`` (``free_page_starts`` with
    ``shared=False``): additionally no page listed twice and every count exactly 1.
    Raises ``IndexOutOfRangeError``, ``ReservedSlotError`` (page 0), ``AlignmentError`` (not a
    page's first slot), ``DoubleFreeError`` (a free: page at count 0 / listed twice) or
    ``RefcountError`` (``share`` of a page at count 0; exclusive free of a shared page).
    """
    ps, n = book.page_size, book.num_pages
    out = (idx < 0) | (idx >= (n + 1) * ps)
    page = torch.div(idx, ps, rounding_mode="floor").clamp(0, n)  # [N]
    count = book.refcount[page]  # [N]
    reserved = ~out & (page == 0)
    off_start = ~out & ~reserved & (torch.remainder(idx, ps) != 0)
    ok = ~(out | reserved | off_start)
    dead = ok & (count == 0)
    srt = torch.sort(page).values
    stats = [out.sum(), reserved.sum(), off_start.sum(), dead.sum()]
    if exclusive:
        stats += [(srt.diff() == 0).sum(), (ok & (count > 1)).sum()]
    vals = torch.stack(stats).tolist()  # the one sync
    if vals[0]:
        raise IndexOutOfRangeError(
            f"{what}: slots {preview(idx[out])} outside 0..{(n + 1) * ps - 1}"
        )
    if vals[1]:
        raise ReservedSlotError(f"{what}: page 0 is padding and is never handed out")
    if vals[2]:
        raise AlignmentError(
            f"{what}: slots {preview(idx[off_start])} do not start a page (slot % {ps} != 0)"
        )
    if vals[3]:
        pages = preview(page[dead])
        if what == "share":
            raise RefcountError(f"share: pages {pages} are not handed out (count 0)")
        raise DoubleFreeError(f"{what}: pages already free: {pages}")
    if exclusive and vals[4]:
        raise DoubleFreeError(f"{what}: a page is listed more than once: "
                              f"{preview(torch.unique(srt[1:][srt.diff() == 0]))}")
    if exclusive and vals[5]:
        shared = ok & (count > 1)
        raise RefcountError(
            f"{what}(shared=False): pages {preview(page[shared])} have other holders (counts "
            f"{preview(count[shared])}); pass shared=True"
        )


def first_occurrence(pages: torch.Tensor) -> torch.Tensor:
    """[N] bool: ``pages[i]`` does not occur in ``pages[:i]``. Sync-free (a stable sort)."""
    order = torch.argsort(pages, stable=True)
    srt = pages[order]
    first_sorted = torch.ones_like(srt, dtype=torch.bool)
    first_sorted[1:] = srt[1:] != srt[:-1]
    first = torch.empty_like(first_sorted)
    first[order] = first_sorted
    return first


def pages_at_zero(refcount: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The distinct pages of ``pages`` [N] whose count is now 0, in first-listed order.

    One host sync: the result's size depends on the counts."""
    return pages[first_occurrence(pages) & (refcount[pages] == 0)]
