"""The engine's sync-free allocator paths (``debug=False``: sized from host lengths, pages
freed by their first slot) hand out and take back exactly what the validated paths do; and
the refcount paths ``share`` / ``attach_shared`` / ``free_page_starts(shared=False)`` read no
device value (on CPU: no Python-level host read; on CUDA: counted with
``torch.cuda.set_sync_debug_mode``, skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from cuda_syncs import count_syncs

from edserve.mem_cache import (
    AlignmentError,
    DoubleFreeError,
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    attach_shared,
    cow_last_pages,
)

from ._helpers import Req


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


class _NoHostReads:
    """CPU stand-in for a sync detector: any Python-level read of a tensor value raises."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(*args, **kwargs):
            raise AssertionError("a host read of a tensor value on a sync-free path")

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def _shared_setup(device, ps: int = 4):
    alloc = _make(ps, False) if device == "cpu" else (
        TokenToKVPoolAllocator(256, device, debug=False) if ps == 1
        else PagedTokenToKVPoolAllocator(256, ps, device, debug=False))
    rtp = ReqToTokenPool(4, 64, device)
    parent, child = Req(), Req()
    row = rtp.alloc([parent])[0]
    n = 10
    out = alloc.alloc_extend(torch.zeros(1, dtype=torch.int64, device=device),
                             torch.tensor([n], device=device), torch.tensor([-1], device=device),
                             n, seq_lens_cpu=[n], prefix_lens_cpu=[0])
    rtp.write(row, 0, out)
    child_row = rtp.alloc([child])[0]
    return alloc, rtp, row, child_row, n


@pytest.mark.parametrize("ps", [1, 4])
def test_share_attach_and_exclusive_free_read_no_host_values_debug_off(ps):
    alloc, rtp, row, child_row, n = _shared_setup("cpu", ps)
    with _NoHostReads():
        attach_shared(rtp, alloc, child_row, rtp.req_to_token[row, :n].long())
        alloc.share(rtp.req_to_token[row, 0:n:ps].long())
    assert alloc.refcounts()[1 : -(-n // ps) + 1].tolist() == [3] * -(-n // ps)
    alloc.free_page_starts(rtp.req_to_token[row, 0:n:ps].long(), shared=True)
    alloc.free_page_starts(rtp.req_to_token[row, 0:n:ps].long(), shared=True)
    with _NoHostReads():
        alloc.free_group_begin()
        alloc.free_page_starts(rtp.req_to_token[child_row, 0:n:ps].long())
        alloc.free_group_end()
    assert alloc.available_size() == alloc.size
    alloc.check_integrity(holders=[])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ps", [1, 16])
def test_cuda_refcount_paths_sync_counts(ps):
    """share / attach_shared / exclusive free: no sync; shared free and cow: one each."""
    dev = torch.device("cuda")
    alloc, rtp, row, child_row, n = _shared_setup(dev, ps)
    kv = KVPool(256, ps, 1, 1, 1, device=dev, check_indices=False)
    starts = rtp.req_to_token[row, 0:n:ps].long()
    assert count_syncs(lambda: torch.ones(1, device=dev).item()) == 1  # the probe works
    assert count_syncs(lambda: attach_shared(rtp, alloc, child_row,
                                              rtp.req_to_token[row, :n].long())) == 0
    assert count_syncs(lambda: alloc.share(starts)) == 0
    assert count_syncs(lambda: alloc.free_page_starts(starts, shared=True)) <= 1
    assert count_syncs(lambda: cow_last_pages(rtp, alloc, kv, [child_row], [n])) <= 1
    alloc.debug = True
    holders = [rtp.req_to_token[r, :n] for r in (row, child_row)]
    alloc.check_integrity(holders=holders)
    copied = ps > 1  # at page size 1 no page is partial: nothing to copy
    assert torch.equal(holders[0] // ps, holders[1] // ps) != copied
    alloc.debug = False
    alloc.free_page_starts(rtp.req_to_token[row, 0:n:ps].long(), shared=True)
    child_starts = rtp.req_to_token[child_row, 0:n:ps].long()
    assert count_syncs(lambda: alloc.free_page_starts(child_starts)) == 0
    alloc.debug = True
    assert alloc.available_size() == alloc.size
    alloc.check_integrity(holders=[])
