"""KV slot allocators: the free list and per-page reference counts behind the KV pool.

Both allocators keep a free list of *pages* (page size 1: a page is a slot). Page ``p`` is slots
``p*ps .. p*ps + ps - 1``; page 0 (slot 0 at page size 1) is padding and never handed out::

    free list   int64 [F]            pages, head = next handed out; frees are prepended (LIFO)
    free mask   bool  [num_pages+1]  mask[p] == (p is on the free list); mask[0] is False
    refcount    int32 [num_pages+1]  holders of page p (rows, held encoder regions); 0 when
                                     free, pending (freed in an open group) or p == 0

A page is handed out at count 1, ``share`` adds holders, the frees drop them, and it returns
to the free list when its count reaches 0 (see ``refcount``). Invariants
(``check_integrity``, see ``integrity``): the free list holds no duplicates, never page 0,
and agrees with the mask; free pages have count 0 and every other page count >= 1, so free +
handed-out pages == ``num_pages``. Every misuse raises a ``KVCacheError`` subclass before any
state changes; running short returns ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from edserve.mem_cache.errors import AlignmentError, IntegrityError, KVCacheError, RefcountError
from edserve.mem_cache.index_args import as_index
from edserve.mem_cache.integrity import check_allocator_integrity
from edserve.mem_cache.page_book import PageBook
from edserve.mem_cache.refcount import check_page_refs, pages_at_zero, validate_free


class BaseAllocator(ABC):
    """Free-list machinery shared by the token (page size 1) and paged allocators.

    Subclasses implement ``alloc_extend`` and ``alloc_decode``: the page layout of a request's
    new tokens. Sizes reported to callers (``size``, ``available_size``, ``num_used``) are in
    slots.
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu",
                 debug: bool = True):
        """``debug``: validate every call's arguments (costs a host<->device sync per call).
        The engine turns it off on its hot path (``--debug-checks``); tests keep it on."""
        self.debug = debug
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"allocator size {size} is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = size // page_size  # pages 1..num_pages are handed out
        self.size = self.num_pages * page_size  # usable slots (floored to whole pages)
        self.device = torch.empty(0, device=device).device
        self._free_group: list[torch.Tensor] | None = None
        self.clear()

    def clear(self) -> None:
        """Mark every page free (drops all allocations; for tests and restarts)."""
        self.book = PageBook.all_free(self.page_size, self.num_pages, self.device)
        self._free_group = None
        self._shared_candidates: list[torch.Tensor] = []  # shared frees of the open group

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Free slots (whole free pages times the page size)."""
        return self.book.free_pages.numel() * self.page_size

    def num_used(self) -> int:
        """Slots on pages that are handed out (cheap: no scan)."""
        return self.size - self.available_size()

    def free_pages(self) -> torch.Tensor:
        """A copy of the free list (pages, head first); for tests and debugging."""
        return self.book.free_pages.clone()

    def refcounts(self) -> torch.Tensor:
        """A copy of the reference counts, int32 [num_pages + 1]; for tests and debugging."""
        return self.book.refcount.clone()

    # ------------------------------------------------------------------ alloc
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots as whole pages (int64 [need_size]), or ``None`` on shortage.

        Paged: ``need_size`` must be a page multiple (``AlignmentError``).
        """
        if need_size < 0:
            raise ValueError(f"alloc: need_size must be >= 0, got {need_size}")
        if need_size % self.page_size:
            raise AlignmentError(
                f"alloc({need_size}) is not a multiple of page_size {self.page_size}"
            )
        n = need_size // self.page_size
        if n > self.book.free_pages.numel():
            return None
        return self._pages_to_slots(self._take_pages(n))

    @abstractmethod
    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        seq_lens_cpu: Sequence[int] | None = None,
        prefix_lens_cpu: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        prefix_lens, seq_lens, last_loc: [B]; ``last_loc[i]`` is the slot of position
        ``prefix_lens[i]-1`` (-1 when the prefix is empty). Returns int64
        [extend_num_tokens] (request order), or ``None`` with state untouched on shortage.
        ``seq_lens_cpu`` / ``prefix_lens_cpu``: the same lengths on the host; with ``debug``
        off they size the allocation without reading the device (no sync).
        """

    @abstractmethod
    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     seq_lens_cpu: Sequence[int] | None = None) -> torch.Tensor | None:
        """One slot per request for position ``seq_lens[i]-1`` (lengths *after* the token).

        last_loc: [B] slot of position ``seq_lens[i]-2`` (-1 when ``seq_lens[i] == 1``).
        Returns int64 [B] or ``None`` with state untouched on shortage. ``seq_lens_cpu``: as
        in :meth:`alloc_extend`.
        """

    def _take_pages(self, n: int) -> torch.Tensor:
        pages = self.book.free_pages[:n]
        self.book.free_pages = self.book.free_pages[n:]
        self.book.is_free.index_fill_(0, pages, False)  # a fill, not a host scalar: no sync
        self.book.refcount.index_fill_(0, pages, 1)
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        if ps == 1:
            return pages.clone()
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        return (pages[:, None] * ps + offsets).reshape(-1)

    # ------------------------------------------------------------------ share / free
    def share(self, first_slots: torch.Tensor) -> None:
        """Add one holder to each page named by its first slot (1-D int, ``slot % ps == 0``).

        A page listed twice gains 2. Sync-free with ``debug`` off (nothing checked); with it
        on, raises before changing anything if a slot is out of range, on page 0, not a page
        start (``AlignmentError``) or names a page that is not handed out (``RefcountError``).
        """
        idx = as_index(first_slots, "share: first_slots", self.device)
        if idx.numel() == 0:
            return
        if self.debug:
            check_page_refs(self.book, idx, "share", exclusive=False)
        self._add_refs(torch.div(idx, self.page_size, rounding_mode="floor"), 1)

    def free(self, indices: torch.Tensor) -> None:
        """Drop one holder from each distinct page holding ``indices`` (slots, any shape);
        pages that reach count 0 return to the free list.

        Paged: each page's first slot must be listed (a partial-page free would release tokens
        not listed: ``AlignmentError``). Raises ``DoubleFreeError`` (a page already at count
        0, or a slot listed twice) / ``ReservedSlotError`` / ``IndexOutOfRangeError`` before
        changing anything. Always validates (host syncs). Inside a free group released pages
        are only queued until ``free_group_end``.
        """
        idx = as_index(indices, "free: indices", self.device)
        if idx.numel() == 0:
            return
        pages = validate_free(self.book, idx)  # distinct
        self._add_refs(pages, -1)
        self._queue_or_release(pages[self.book.refcount[pages] == 0])

    def free_page_starts(self, first_slots: torch.Tensor, shared: bool = False) -> None:
        """Drop one holder from each page named by its first slot (``slot % page_size == 0``),
        e.g. a row's ``req_to_token[row, 0:len:page_size]``; pages at count 0 are released.

        ``shared=False`` (the engine's hot path, sync-free): the caller promises every named
        page is listed once and has count 1, so every page is released; with ``debug`` on
        that is verified (``DoubleFreeError`` / ``RefcountError`` / ``AlignmentError``).
        ``shared=True``: pages may have other holders and may be listed more than once (each
        listing drops one holder); finding which pages reached 0 costs one host sync (once
        per free group: inside a group the search waits for ``free_group_end``).
        Released pages are prepended in first-listed order (LIFO reuse).
        """
        idx = as_index(first_slots, "free_page_starts: first_slots", self.device)
        if idx.numel() == 0:
            return
        if self.debug:
            check_page_refs(self.book, idx, "free_page_starts", exclusive=not shared)
        pages = torch.div(idx, self.page_size, rounding_mode="floor")  # in the given order
        self._add_refs(pages, -1)
        if shared and self._free_group is not None:
            self._shared_candidates.append(pages)  # resolved at free_group_end
        elif shared:
            self._queue_or_release(pages_at_zero(self.book.refcount, pages))  # the one sync
        else:
            self._queue_or_release(pages)

    def drop_holds(self, first_slots: torch.Tensor) -> None:
        """Drop one holder from each page named by its first slot where the caller knows
        another holder stays (a page listed k times has count > k): nothing is released, so
        nothing is read (sync-free with ``debug`` off; with it on, raises ``RefcountError``
        before changing anything unless every page keeps a holder)."""
        idx = as_index(first_slots, "drop_holds: first_slots", self.device)
        if idx.numel() == 0:
            return
        pages = torch.div(idx, self.page_size, rounding_mode="floor")
        if self.debug:
            check_page_refs(self.book, idx, "drop_holds", exclusive=False)
            left = self.book.refcount.clone().index_add_(
                0, pages, torch.full(pages.shape, -1, dtype=torch.int32, device=self.device))
            if bool((left[pages] < 1).any()):
                raise RefcountError(f"drop_holds: pages {pages[left[pages] < 1].tolist()} would "
                                    "lose their last holder")
        self._add_refs(pages, -1)

    def _add_refs(self, pages: torch.Tensor, delta: int) -> None:
        """``count[pages] += delta`` (repeated pages accumulate); sync-free."""
        step = torch.full(pages.shape, delta, dtype=torch.int32, device=self.device)
        self.book.refcount.index_add_(0, pages, step)

    def _queue_or_release(self, pages: torch.Tensor) -> None:
        """Release pages at count 0, or queue them while a free group is open."""
        if self._free_group is not None:
            self._free_group.append(pages)
        else:
            self._release(pages)

    def free_group_begin(self) -> None:
        """Queue releases until ``free_group_end`` releases them in one operation.

        Counts drop at once, so a page freed twice in a group (two holders) is queued once,
        when its count reaches 0; a queued page has count 0 and cannot be freed again."""
        if self._free_group is not None:
            raise KVCacheError("free_group_begin: a free group is already open (no nesting)")
        self._free_group = []
        self._shared_candidates = []

    @property
    def in_free_group(self) -> bool:
        return self._free_group is not None

    def free_group_end(self) -> None:
        """Release every page queued since ``free_group_begin``."""
        if self._free_group is None:
            raise KVCacheError("free_group_end without free_group_begin")
        group, self._free_group = self._free_group, None
        if self._shared_candidates:  # pages of shared frees that reached 0: one sync
            group.append(pages_at_zero(self.book.refcount, torch.cat(self._shared_candidates)))
            self._shared_candidates = []
        if group:
            self._release(torch.cat(group))

    def _release(self, pages: torch.Tensor) -> None:
        self.book.is_free.index_fill_(0, pages, True)
        self.book.free_pages = torch.cat([pages, self.book.free_pages])  # prepend: LIFO reuse

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, owned: torch.Tensor | None = None,
                        holders: Sequence[torch.Tensor] | None = None) -> None:
        """Raise ``IntegrityError`` unless the free list is clean and pages are conserved.

        owned: slots held by requests that share nothing (each slot listed once), e.g. every
        row's ``req_to_token[row, :len]`` concatenated: free + owned pages == ``num_pages``,
        no page both, every owned page at count 1. holders: one tensor per holder (a row's
        prefix, a held encoder region; each slot once per holder, holders may overlap): every
        page's count == the number of holders touching it. See ``integrity``.
        """
        if self._free_group is not None:
            raise IntegrityError("check_integrity inside an open free group")
        check_allocator_integrity(self.book, owned, holders)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )
