"""The engine's sync-free allocator paths (``debug=False``: sized from host lengths, pages
freed by their first slot) hand out and take back exactly what the validated paths do."""

from __future__ import annotations

import pytest
import torch

from edserve.mem_cache import (
    AlignmentError,
    DoubleFreeError,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)


def _make(ps: int, debug: bool):
    if ps == 1:
        return TokenToKVPoolAllocator(256, debug=debug)
    return PagedTokenToKVPoolAllocator(256, ps, debug=debug)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_debug_off_matches_debug_on(ps):
    gen = torch.Generator().manual_seed(ps)
    allocs = [_make(ps, True), _make(ps, False)]
    rows: list[list[list[int]]] = [[], []]  # per allocator: each live request's slots
    for step in range(60):
        op = int(torch.randint(0, 3, (1,), generator=gen))
        for a, live in zip(allocs, rows, strict=True):
            if op == 0 or not live:  # a new request of a random length
                n = 1 + (step * 7) % 23
                lens = torch.tensor([n])
                out = a.alloc_extend(torch.zeros(1, dtype=torch.int64), lens,
                                     torch.tensor([-1]), n, seq_lens_cpu=[n],
                                     prefix_lens_cpu=[0])
                if out is not None:
                    live.append(out.tolist())
            elif op == 1:  # one decode token for every live request
                seq = [len(r) + 1 for r in live]
                last = torch.tensor([r[-1] for r in live])
                out = a.alloc_decode(torch.tensor(seq), last, seq_lens_cpu=seq)
                if out is not None:
                    for r, s in zip(live, out.tolist(), strict=True):
                        r.append(s)
            else:  # free the oldest request by its pages' first slots
                r = live.pop(0)
                a.free_page_starts(torch.tensor(r[::ps]))
        assert rows[0] == rows[1]
        assert torch.equal(allocs[0].free_pages(), allocs[1].free_pages())
    for a, live in zip(allocs, rows, strict=True):
        owned = torch.tensor([s for r in live for s in r], dtype=torch.int64)
        a.check_integrity(owned)


def test_free_page_starts_validates_under_debug():
    a = PagedTokenToKVPoolAllocator(64, 4, debug=True)
    slots = a.alloc(8)  # two pages
    with pytest.raises(AlignmentError):
        a.free_page_starts(slots[1:2])  # not a page's first slot
    a.free_page_starts(slots[::4])
    with pytest.raises(DoubleFreeError):
        a.free_page_starts(slots[::4])
    a.check_integrity(torch.zeros(0, dtype=torch.int64))
