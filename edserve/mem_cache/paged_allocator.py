"""PagedTokenToKVPoolAllocator: hands out whole pages of ``page_size`` slots.

Pages ``1 .. size // page_size`` are handed out; page 0 is padding. Slot ``s`` belongs to page
``s // page_size``. A request owns whole pages, and its tokens fill each page in order from
offset 0 (see ``layout``), so ``req_to_token[row, ::ps] // ps`` is its page table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.layout import (
    as_index,
    check_decode_args,
    check_extend_args,
    decode_slots,
    extend_slots,
)


class PagedTokenToKVPoolAllocator(BaseAllocator):
    """Page-granular allocator; see ``BaseAllocator`` for the shared contract."""

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu",
                 debug: bool = True):
        super().__init__(size, page_size, device, debug)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        seq_lens_cpu: Sequence[int] | None = None,
        prefix_lens_cpu: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """Fill each request's partial last page from ``last_loc + 1``, then whole new pages,
        then a tail page. Returns int64 [extend_num_tokens] or ``None`` (nothing taken)."""
        if self.debug or seq_lens_cpu is None or prefix_lens_cpu is None:
            prefix, seq, last, num_new_pages = check_extend_args(
                self.book, prefix_lens, seq_lens, last_loc, extend_num_tokens
            )
        else:  # sized from the host lengths: no device read
            prefix, seq, last = (as_index(t, self.device) for t in (prefix_lens, seq_lens,
                                                                     last_loc))
            ps = self.page_size
            num_new_pages = sum(-(-s // ps) - -(-p // ps)
                                for s, p in zip(seq_lens_cpu, prefix_lens_cpu, strict=True))
        if num_new_pages > self.book.free_pages.numel():
            return None
        pages = self._take_pages(num_new_pages)
        return extend_slots(prefix, seq, last, pages, self.page_size, extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     seq_lens_cpu: Sequence[int] | None = None) -> torch.Tensor | None:
        """``last_loc + 1``, or a fresh page where ``(seq_len - 1) % page_size == 0``.
        Returns int64 [B] or ``None`` (nothing taken)."""
        ps = self.page_size
        if self.debug or seq_lens_cpu is None:
            _, last, new_page, num_new_pages = check_decode_args(self.book, seq_lens, last_loc)
        else:  # sized from the host lengths: no device read
            seq, last = as_index(seq_lens, self.device), as_index(last_loc, self.device)
            new_page = torch.remainder(seq - 1, ps) == 0  # [B]
            num_new_pages = sum((s - 1) % ps == 0 for s in seq_lens_cpu)
        if num_new_pages > self.book.free_pages.numel():
            return None
        pages = self._take_pages(num_new_pages)
        return decode_slots(last, new_page, pages, self.page_size)
