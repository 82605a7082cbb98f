"""PagedTokenToKVPoolAllocator: hands out whole pages of ``page_size`` slots.

Pages ``1 .. size // page_size`` are handed out; page 0 is padding. Slot ``s`` belongs to page
``s // page_size``. A request owns whole pages, and its tokens fill each page in order from
offset 0 (see ``layout``), so ``req_to_token[row, ::ps] // ps`` is its page table.
"""

from __future__ import annotations

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.layout import (
    check_decode_args,
    check_extend_args,
    decode_slots,
    extend_slots,
)


class PagedTokenToKVPoolAllocator(BaseAllocator):
    """Page-granular allocator; see ``BaseAllocator`` for the shared contract."""

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu"):
        super().__init__(size, page_size, device)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Fill each request's partial last page from ``last_loc + 1``, then whole new pages,
        then a tail page. Returns int64 [extend_num_tokens] or ``None`` (nothing taken)."""
        prefix, seq, last, num_new_pages = check_extend_args(
            self, prefix_lens, seq_lens, last_loc, extend_num_tokens
        )
        if num_new_pages > self._free_pages.numel():
            return None
        pages = self._take_pages(num_new_pages)
        return extend_slots(prefix, seq, last, pages, self.page_size, extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """``last_loc + 1``, or a fresh page where ``(seq_len - 1) % page_size == 0``.
        Returns int64 [B] or ``None`` (nothing taken)."""
        _, last, new_page, num_new_pages = check_decode_args(self, seq_lens, last_loc)
        if num_new_pages > self._free_pages.numel():
            return None
        pages = self._take_pages(num_new_pages)
        return decode_slots(last, new_page, pages, self.page_size)
