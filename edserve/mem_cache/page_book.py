"""The page state an allocator keeps, in one leaf type its checks can read.

    free_pages  int64 [F]             free pages, LIFO: alloc takes from the head
    is_free     bool  [num_pages + 1] page p is on the free list (page 0 never)
    refcount    int32 [num_pages + 1] holders of page p (rows, held encoder regions); 0 when
                                      free and on page 0

Page ``p`` covers slots ``p * page_size .. (p + 1) * page_size - 1``; page 0 is padding. The
allocator (:mod:`.allocator`) owns and mutates a ``PageBook``; the checks in :mod:`.integrity`,
:mod:`.layout` and :mod:`.refcount` only read it, so they never import the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PageBook:
    page_size: int
    num_pages: int
    device: torch.device
    free_pages: torch.Tensor  # int64 [F]
    is_free: torch.Tensor  # bool [num_pages + 1]
    refcount: torch.Tensor  # int32 [num_pages + 1]

    @classmethod
    def all_free(cls, page_size: int, num_pages: int, device: torch.device) -> PageBook:
        """Every page 1..num_pages free, no holders."""
        is_free = torch.ones(num_pages + 1, dtype=torch.bool, device=device)
        is_free[0] = False
        return cls(page_size, num_pages, device,
                   free_pages=torch.arange(1, num_pages + 1, dtype=torch.int64, device=device),
                   is_free=is_free,
                   refcount=torch.zeros(num_pages + 1, dtype=torch.int32, device=device))
