"""TokenToKVPoolAllocator: the page-size-1 allocator (one slot per page)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edserve.mem_cache.allocator import BaseAllocator
from edserve.mem_cache.layout import check_decode_args, check_extend_args


class TokenToKVPoolAllocator(BaseAllocator):
    """Page size 1: hands out single slots ``1..size``; slot 0 is never handed out.

    With one slot per page any layout is contiguous within a page, so extend and decode are a
    plain ``alloc``.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", debug: bool = True):
        super().__init__(size, 1, device, debug)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        seq_lens_cpu: Sequence[int] | None = None,
        prefix_lens_cpu: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        if self.debug:
            check_extend_args(self.book, prefix_lens, seq_lens, last_loc, extend_num_tokens)
        return self.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     seq_lens_cpu: Sequence[int] | None = None) -> torch.Tensor | None:
        if self.debug:
            check_decode_args(self.book, seq_lens, last_loc)
        return self.alloc(int(seq_lens.numel()))
