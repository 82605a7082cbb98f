"""Errors raised by the KV-cache machinery.

Contract shared by every pool and allocator in this package: a misuse is detected and raised
**before** any state is mutated, so after catching one of these the pool is exactly as it was
(``check_integrity()`` still passes). Running out of rows or slots is not an error: ``alloc*``
returns ``None`` (the scheduler's back-pressure signal).
"""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """Base class: a caller misused a KV-cache pool or allocator."""


class DoubleFreeError(KVCacheError):
    """A row, slot or page was freed while already free (or listed twice in one free)."""


class ReservedSlotError(KVCacheError):
    """Row 0, slot 0 or page 0 (padding for graph-padded batches) was freed or written."""


class AlignmentError(KVCacheError):
    """A paged ``alloc`` of a size that is not a page multiple, a partial-page free, or an
    extend/decode whose ``last_loc`` does not sit where the page layout says it must."""


class IndexOutOfRangeError(KVCacheError):
    """A row, slot, page or layer index outside the pool."""


class ContextOverflowError(KVCacheError):
    """A write into ``req_to_token`` past ``max_context_len`` columns."""


class PoolTooSmallError(KVCacheError):
    """Sizing: the memory budget does not hold even one request of ``max_context_len``."""


class IntegrityError(KVCacheError):
    """An invariant check failed: leaked, duplicated or reserved entries in a free list."""


class RefcountError(KVCacheError):
    """A page reference misuse: ``share`` of a page that is not handed out, or an exclusive
    ``free_page_starts(shared=False)`` of a page that other holders still reference."""
