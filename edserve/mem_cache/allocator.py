"""KV slot allocators: the free list behind the KV pool.

Both allocators keep a free list of *pages* (page size 1: a page is a slot). Page ``p`` is slots
``p*ps .. p*ps + ps - 1``; page 0 (slot 0 at page size 1) is padding and never handed out::

    free list   int64 [F]            pages, head = next handed out; frees are prepended (LIFO)
    free mask   bool  [num_pages+1]  mask[p] == (p is on the free list); mask[0] is False

Invariants (``check_integrity``): the free list holds no duplicates, never page 0, and agrees
with the mask; free pages + pages owned by requests == ``num_pages``. Every misuse raises a
``KVCacheError`` subclass before any state changes; running short returns ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from edserve.mem_cache.errors import (
    AlignmentError,
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVCacheError,
    ReservedSlotError,
)


def _as_index(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """1-D int64 copy of an integer tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t.reshape(-1).to(device=device, dtype=torch.int64)


def _preview(t: torch.Tensor, n: int = 8) -> str:
    vals = t[:n].tolist()
    return f"{vals}{' ...' if t.numel() > n else ''}"


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
        # [F] int64 free pages; alloc takes from the head.
        self._free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        # [num_pages + 1] bool; page 0 never free.
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._is_free[0] = False
        self._pending = torch.zeros_like(self._is_free)  # pages freed inside an open group
        self._free_group = None

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Free slots (whole free pages times the page size)."""
        return self._free_pages.numel() * self.page_size

    def num_used(self) -> int:
        """Slots on pages that are handed out (cheap: no scan)."""
        return self.size - self.available_size()

    def free_pages(self) -> torch.Tensor:
        """A copy of the free list (pages, head first); for tests and debugging."""
        return self._free_pages.clone()

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
        if n > self._free_pages.numel():
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
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        self._is_free.index_fill_(0, pages, False)  # a fill, not a host scalar: no sync
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        if ps == 1:
            return pages.clone()
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        return (pages[:, None] * ps + offsets).reshape(-1)

    # ------------------------------------------------------------------ free
    def free(self, indices: torch.Tensor) -> None:
        """Return the pages holding ``indices`` (slots, any shape) to the free list.

        Paged: frees the distinct pages ``unique(indices // page_size)``; each page's first
        slot must be listed (a partial-page free would release tokens not listed:
        ``AlignmentError``). Raises ``DoubleFreeError`` / ``ReservedSlotError`` /
        ``IndexOutOfRangeError`` before changing anything. Inside a free group the pages are
        only queued until ``free_group_end``.
        """
        idx = _as_index(indices, "free: indices", self.device)
        if idx.numel() == 0:
            return
        pages = self._validate_free(idx)
        self._queue_or_release(pages)

    def free_page_starts(self, first_slots: torch.Tensor) -> None:
        """Return whole pages, each named once by its first slot (``slot % page_size == 0``).

        The sync-free free of the engine's hot path: with ``debug`` off nothing is checked
        (one slot per page, from a row's ``req_to_token[row, 0:len:page_size]``); with it on,
        the arguments are validated as in :meth:`free`.
        """
        idx = _as_index(first_slots, "free_page_starts: first_slots", self.device)
        if idx.numel() == 0:
            return
        if self.debug and self._validate_free(idx).numel() != idx.numel():
            raise AlignmentError("free_page_starts: every slot must start its own page")
        pages = torch.div(idx, self.page_size, rounding_mode="floor")  # in the given order
        self._queue_or_release(pages)

    def _queue_or_release(self, pages: torch.Tensor) -> None:
        if self._free_group is not None:
            self._pending.index_fill_(0, pages, True)
            self._free_group.append(pages)
        else:
            self._release(pages)

    def free_group_begin(self) -> None:
        """Queue frees until ``free_group_end`` releases them in one operation."""
        if self._free_group is not None:
            raise KVCacheError("free_group_begin: a free group is already open (no nesting)")
        self._free_group = []

    def free_group_end(self) -> None:
        """Release every page queued since ``free_group_begin``."""
        if self._free_group is None:
            raise KVCacheError("free_group_end without free_group_begin")
        group, self._free_group = self._free_group, None
        if group:
            pages = torch.cat(group)
            self._pending.index_fill_(0, pages, False)
            self._release(pages)

    def _release(self, pages: torch.Tensor) -> None:
        self._is_free.index_fill_(0, pages, True)
        self._free_pages = torch.cat([pages, self._free_pages])  # prepend: LIFO reuse

    def _validate_free(self, idx: torch.Tensor) -> torch.Tensor:
        """Distinct pages of the slots ``idx``, or raise; never mutates."""
        ps = self.page_size
        end = (self.num_pages + 1) * ps
        lo, hi = torch.stack([idx.min(), idx.max()]).tolist()
        if lo < 0 or hi >= end:
            bad = idx[(idx < 0) | (idx >= end)]
            raise IndexOutOfRangeError(f"free: slots {_preview(bad)} outside 0..{end - 1}")
        if lo < ps:
            what = "slot 0" if ps == 1 else f"page 0 (slots 0..{ps - 1})"
            raise ReservedSlotError(f"free: {what} is padding and is never handed out")
        uniq, counts = torch.unique(idx, return_counts=True)  # sorted
        if uniq.numel() != idx.numel():
            dups = _preview(uniq[counts > 1])
            raise DoubleFreeError(f"free: slots listed more than once: {dups}")
        pages = torch.unique_consecutive(uniq // ps)
        if ps > 1:
            starts = uniq[uniq % ps == 0] // ps
            if starts.numel() != pages.numel():
                missing = pages[~torch.isin(pages, starts)]
                raise AlignmentError(
                    f"free: partial-page free of pages {_preview(missing)}: their first slot is "
                    f"not listed, so freeing them would release tokens the caller did not list"
                )
        taken = self._is_free[pages] | self._pending[pages]
        if bool(taken.any()):
            raise DoubleFreeError(f"free: pages already free: {_preview(pages[taken])}")
        return pages

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, owned: torch.Tensor | None = None) -> None:
        """Raise ``IntegrityError`` unless the free list is clean and conserves pages.

        owned: slots held by requests (each slot listed once), e.g. every request's row prefix
        ``req_to_token[row, :len]``. With ``owned``, free pages + owned pages must equal
        ``num_pages`` and no page may be both.
        """
        if self._free_group is not None:
            raise IntegrityError("check_integrity inside an open free group")
        free = self._free_pages
        if free.numel():
            if bool((free == 0).any()):
                raise IntegrityError("page 0 (padding) is on the free list")
            bad = free[(free < 1) | (free > self.num_pages)]
            if bad.numel():
                raise IntegrityError(f"free list holds pages outside 1..{self.num_pages}: {bad}")
            uniq, counts = torch.unique(free, return_counts=True)
            if uniq.numel() != free.numel():
                raise IntegrityError(f"free list holds pages twice: {_preview(uniq[counts > 1])}")
        if int(self._is_free.sum()) != free.numel() or not bool(self._is_free[free].all()):
            raise IntegrityError("free list and free mask disagree")
        if owned is None:
            return
        own = _as_index(owned, "check_integrity: owned", self.device)
        ps = self.page_size
        if own.numel():
            uniq, counts = torch.unique(own, return_counts=True)
            if uniq.numel() != own.numel():
                raise IntegrityError(f"slots owned twice: {_preview(uniq[counts > 1])}")
            if int(uniq[0]) < ps or int(uniq[-1]) >= (self.num_pages + 1) * ps:
                raise IntegrityError(
                    f"owned slots outside the pool's pages 1..{self.num_pages}: min "
                    f"{int(uniq[0])} max {int(uniq[-1])}"
                )
        owned_pages = torch.unique(own // ps)
        both = owned_pages[self._is_free[owned_pages]]
        if both.numel():
            raise IntegrityError(f"pages both free and owned: {_preview(both)}")
        if free.numel() + owned_pages.numel() != self.num_pages:
            seen = self._is_free.clone()
            seen[owned_pages] = True
            leaked = torch.nonzero(~seen[1:]).reshape(-1) + 1
            raise IntegrityError(
                f"free pages ({free.numel()}) + owned pages ({owned_pages.numel()}) != total "
                f"pages ({self.num_pages}): {leaked.numel()} leaked, e.g. {_preview(leaked)}"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )
