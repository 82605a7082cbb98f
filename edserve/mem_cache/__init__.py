"""The KV-cache memory system: request-to-token table, KV pool, slot allocators, sizing.

Data flow for an extend batch::

    ReqToTokenPool.alloc(reqs)         -> rows of req_to_token
    allocator.alloc_extend(...)        -> out_cache_loc (KV slots of the new tokens)
    write_cache_indices(...)           -> req_to_token[row] = [prefix slots | new slots]
    KVPool.set_kv(layer, loc, k, v)    -> K/V written at those slots
    page_table_from_req_to_token(...)  -> page tables for paged attention kernels

``alloc_for_extend`` does the first three steps with no leak on shortage.

Shared pages: every page has a reference count (``BaseAllocator.share`` / the frees);
``fork_row`` / ``attach_shared`` share a prefix of a row and ``cow_last_pages`` copies a shared
partial last page before a holder writes into it (see ``fork``).
"""

from edserve.mem_cache.allocation import alloc_for_extend, write_cache_indices
from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.errors import (
    AlignmentError,
    ContextOverflowError,
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVCacheError,
    PoolTooSmallError,
    RefcountError,
    ReservedSlotError,
)
from edserve.mem_cache.fork import (
    attach_shared,
    cow_last_pages,
    fork_row,
    fork_rows,
    row_page_starts,
)
from edserve.mem_cache.kv_pool import KVPool
from edserve.mem_cache.page_table import page_table_from_req_to_token
from edserve.mem_cache.paged_allocator import PagedTokenToKVPoolAllocator
from edserve.mem_cache.reorder import private_tails, reorder_rows
from edserve.mem_cache.req_to_token import ReqToTokenPool
from edserve.mem_cache.sizing import KVCacheConfig, KVCachePlan, plan_kv_cache
from edserve.mem_cache.token_allocator import TokenToKVPoolAllocator

__all__ = [
    "AlignmentError",
    "BaseAllocator",
    "ContextOverflowError",
    "DoubleFreeError",
    "IndexOutOfRangeError",
    "IntegrityError",
    "KVCacheConfig",
    "KVCacheError",
    "KVCachePlan",
    "KVPool",
    "PagedTokenToKVPoolAllocator",
    "PoolTooSmallError",
    "RefcountError",
    "ReqToTokenPool",
    "ReservedSlotError",
    "TokenToKVPoolAllocator",
    "alloc_for_extend",
    "attach_shared",
    "cow_last_pages",
    "private_tails",
    "reorder_rows",
    "fork_row",
    "fork_rows",
    "row_page_starts",
    "page_table_from_req_to_token",
    "plan_kv_cache",
    "write_cache_indices",
]
