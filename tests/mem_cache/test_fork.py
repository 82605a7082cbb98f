"""Shared pages: refcounts, ``fork_row`` / ``attach_shared``, ``cow_last_pages``, misuse."""

from __future__ import annotations

import pytest
import torch

from edserve.mem_cache import (
    AlignmentError,
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVPool,
    PagedTokenToKVPoolAllocator,
    RefcountError,
    ReqToTokenPool,
    ReservedSlotError,
    attach_shared,
    cow_last_pages,
    fork_row,
    fork_rows,
    row_page_starts,
)

from ._helpers import Req, snapshot, t


class Setup:
    """A paged allocator, a row pool and a 1-layer KV pool whose K stores token values."""

    def __init__(self, ps: int, num_pages: int, max_ctx: int, rows: int = 4):
        self.ps = ps
        self.alloc = PagedTokenToKVPoolAllocator(num_pages * ps, ps)
        self.rtp = ReqToTokenPool(rows, max_ctx)
        self.kv = KVPool(num_pages * ps, ps, 1, 1, 1)
        self.next_value = 1.0

    def new_row(self, n: int) -> Req:
        r = Req()
        row = self.rtp.alloc([r])[0]
        out = self.alloc.alloc_extend(t([0]), t([n]), t([-1]), n)
        self._write(r, row, 0, out)
        return r

    def append(self, r: Req, k: int) -> None:
        """cow, then ``k`` new tokens at the end of ``r``'s row."""
        row, n = r.req_pool_idx, len(r.slots)
        assert cow_last_pages(self.rtp, self.alloc, self.kv, [row], [n])
        last = int(self.rtp.req_to_token[row, n - 1]) if n else -1
        out = self.alloc.alloc_extend(t([n]), t([n + k]), t([last]), k)
        self._write(r, row, n, out)

    def _write(self, r: Req, row: int, start: int, out: torch.Tensor) -> None:
        vals = torch.arange(out.numel(), dtype=torch.float32) + self.next_value
        self.next_value += out.numel()
        self.kv.set_kv(0, out, vals[:, None, None], -vals[:, None, None])
        self.rtp.write(row, start, out)
        r.slots = r.slots[:start] + vals.tolist()  # the model: token values of the row

    def read(self, r: Req) -> list[float]:
        n = len(r.slots)
        return self.kv.k_buffers[0][self.rtp.req_to_token[r.req_pool_idx, :n].long(), 0, 0].tolist()

    def holders(self, reqs: list[Req]) -> list[torch.Tensor]:
        return [self.rtp.req_to_token[r.req_pool_idx, : len(r.slots)] for r in reqs]

    def fork(self, parent: Req) -> Req:
        child = Req()
        assert fork_row(self.rtp, self.alloc, parent.req_pool_idx, child, len(parent.slots))
        child.slots = list(parent.slots)
        return child


def pages_of(s: Setup, r: Req) -> list[int]:
    return (s.rtp.req_to_token[r.req_pool_idx, 0 : len(r.slots) : s.ps].long() // s.ps).tolist()


def test_fork_shares_pages_without_taking_any():
    s = Setup(4, 16, 32)
    p = s.new_row(10)  # pages: 2 full + 1 holding 2 tokens
    free_before = s.alloc.available_size()
    c = s.fork(p)
    assert s.alloc.available_size() == free_before
    rc = s.alloc.refcounts()
    assert rc[pages_of(s, p)].tolist() == [2, 2, 2]
    assert s.read(c) == s.read(p) == p.slots
    s.alloc.check_integrity(holders=s.holders([p, c]))
    with pytest.raises(IntegrityError, match="refcount != 1"):
        s.alloc.check_integrity(torch.cat(s.holders([p])))


@pytest.mark.parametrize("ps", [1, 4])
def test_fork_rows_batch_equals_one_by_one(ps):
    """fork_rows (one batch of device ops) shares the same pages, counts and views as
    fork_row called per child, a parent listed twice included."""
    results = []
    for batched in (False, True):
        s = Setup(ps, 64, 40, rows=8)
        a, b = s.new_row(9), s.new_row(3)
        kids = [Req() for _ in range(3)]
        parents = [a, a, b]
        if batched:
            rows = fork_rows(s.rtp, s.alloc, [p.req_pool_idx for p in parents], kids,
                             [len(p.slots) for p in parents])
            assert rows == [k.req_pool_idx for k in kids]
        else:
            for k, p in zip(kids, parents, strict=True):
                assert fork_row(s.rtp, s.alloc, p.req_pool_idx, k, len(p.slots))
        for k, p in zip(kids, parents, strict=True):
            k.slots = list(p.slots)
            assert s.read(k) == p.slots
        s.alloc.check_integrity(holders=s.holders([a, b, *kids]))
        starts = row_page_starts(s.rtp, [a.req_pool_idx, b.req_pool_idx], [9, 3], ps)
        assert starts.tolist() == torch.cat([s.rtp.req_to_token[a.req_pool_idx, 0:9:ps],
                                             s.rtp.req_to_token[b.req_pool_idx, 0:3:ps]]
                                            ).tolist()
        results.append(s.alloc.refcounts().tolist())
    assert results[0] == results[1]
    s = Setup(ps, 64, 40, rows=2)
    a = s.new_row(5)
    before = snapshot(s.alloc)
    assert fork_rows(s.rtp, s.alloc, [a.req_pool_idx] * 2, [Req(), Req()], [5, 5]) is None
    assert snapshot(s.alloc) == before  # no row for both: nothing changed


def test_cow_copies_exactly_one_page_and_only_when_shared():
    s = Setup(4, 16, 32)
    p = s.new_row(10)
    c = s.fork(p)
    free_before = s.alloc.available_size()
    s.append(c, 1)  # copies page 3 (2 tokens), then fills its offset 2
    assert s.alloc.available_size() == free_before - 4
    assert pages_of(s, c)[:2] == pages_of(s, p)[:2] and pages_of(s, c)[2] != pages_of(s, p)[2]
    rc = s.alloc.refcounts()
    assert rc[pages_of(s, p)].tolist() == [2, 2, 1] and int(rc[pages_of(s, c)[2]]) == 1
    s.append(p, 1)  # the parent's page is its own again: written in place, nothing taken
    assert s.alloc.available_size() == free_before - 4
    assert s.read(p) == p.slots and s.read(c) == c.slots and p.slots[10] != c.slots[10]
    before = snapshot(s.alloc)
    assert cow_last_pages(s.rtp, s.alloc, s.kv, [c.req_pool_idx], [len(c.slots)])
    assert snapshot(s.alloc) == before  # not shared any more: nothing to do
    # a fork at a page boundary shares only whole pages: nothing to copy
    d = s.new_row(8)
    e = s.fork(d)
    before = snapshot(s.alloc)
    assert cow_last_pages(s.rtp, s.alloc, s.kv, [e.req_pool_idx], [8])
    assert snapshot(s.alloc) == before
    s.alloc.check_integrity(holders=s.holders([p, c, d, e]))


def test_cow_when_every_holder_is_listed_keeps_the_page_with_the_last():
    s = Setup(4, 16, 32)
    p = s.new_row(6)
    c = s.fork(p)
    free_before = s.alloc.available_size()
    rows = [p.req_pool_idx, c.req_pool_idx]
    assert cow_last_pages(s.rtp, s.alloc, s.kv, rows, [6, 6])
    assert s.alloc.available_size() == free_before - 4  # one copy, not two
    assert pages_of(s, c)[1] != pages_of(s, p)[1]
    assert s.alloc.refcounts()[pages_of(s, p)].tolist() == [2, 1]
    s.alloc.check_integrity(holders=s.holders([p, c]))
    assert s.read(p) == s.read(c) == p.slots


@pytest.mark.parametrize("via_fork", [True, False])
def test_flat_encoder_region_ending_mid_page(via_fork):
    """Encoder 1500 tokens at page size 128: its last page holds 92 and is shared."""
    s = Setup(128, 40, 2048)
    enc = s.new_row(1500)  # the holder of the encoder region (a row here)
    if via_fork:
        s.append(enc, 3)  # 3 decoder tokens on the encoder's last page
        req = s.fork(enc)
    else:  # a request reusing the held encoder region
        req = Req()
        row = s.rtp.alloc([req])[0]
        attach_shared(s.rtp, s.alloc, row, s.rtp.req_to_token[enc.req_pool_idx, :1500].long())
        req.slots = enc.slots[:1500]
    n = len(req.slots)
    assert s.alloc.refcounts()[pages_of(s, enc)].tolist() == [2] * 12
    free_before = s.alloc.available_size()
    s.append(req, 2)  # copies page 11 (1408 .. n-1) once
    s.append(req, 130)  # then whole fresh pages
    assert s.alloc.available_size() == free_before - 128 * 2
    s.append(enc, 1)  # the other holder keeps its page: written in place
    assert s.alloc.available_size() == free_before - 128 * 2
    assert s.read(req) == req.slots and s.read(enc) == enc.slots
    assert req.slots[:n] == enc.slots[:n] and req.slots[n] != enc.slots[n]
    assert s.kv.v_buffers[0][s.rtp.req_to_token[req.req_pool_idx, :n].long(), 0, 0].tolist() \
        == [-v for v in req.slots[:n]]
    s.alloc.check_integrity(holders=s.holders([enc, req]))
    for r in (req, enc):
        s.alloc.free_page_starts(s.rtp.req_to_token[r.req_pool_idx, 0 : len(r.slots) : 128],
                                 shared=True)
        s.rtp.free(r)
    assert s.alloc.available_size() == s.alloc.size
    assert int(s.alloc.refcounts().abs().sum()) == 0
    s.alloc.check_integrity(holders=[])


def test_cow_shortage_returns_false_and_changes_nothing():
    s = Setup(4, 4, 16)
    p = s.new_row(14)  # all 4 pages
    c = s.fork(p)
    before = (snapshot(s.alloc), s.rtp.req_to_token.clone(), s.kv.k_buffers[0].clone())
    assert not cow_last_pages(s.rtp, s.alloc, s.kv, [c.req_pool_idx], [14])
    after = (snapshot(s.alloc), s.rtp.req_to_token, s.kv.k_buffers[0])
    assert before[0] == after[0]
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
    s.alloc.check_integrity(holders=s.holders([p, c]))


def test_fork_without_a_free_row_returns_none():
    s = Setup(4, 16, 32, rows=1)
    p = s.new_row(5)
    before = snapshot(s.alloc)
    child = Req()
    assert fork_row(s.rtp, s.alloc, p.req_pool_idx, child, 5) is None
    assert child.req_pool_idx is None and snapshot(s.alloc) == before


def test_share_misuse_raises_before_changing_anything():
    a = PagedTokenToKVPoolAllocator(64, 4)
    x = a.alloc(8)  # pages 1, 2 = slots 4..11
    before = snapshot(a)
    for exc, idx in [
        (RefcountError, t([12])),  # page 3 is free
        (ReservedSlotError, t([0])),
        (IndexOutOfRangeError, t([68])),
        (IndexOutOfRangeError, t([-4])),
        (AlignmentError, t([5])),  # not a page start
        (RefcountError, t([4, 12])),  # one good, one free: nothing applied
    ]:
        with pytest.raises(exc):
            a.share(idx)
        assert snapshot(a) == before
    a.share(t([4, 4, 8]))  # listed twice: +2
    assert a.refcounts()[1:3].tolist() == [3, 2]
    a.check_integrity(holders=[x, x[:4], x[:4], x[4:]])


def test_free_page_starts_exclusive_misuse_and_shared_frees():
    a = PagedTokenToKVPoolAllocator(64, 4)
    x = a.alloc(8)
    a.share(t([4]))  # page 1 has two holders
    before = snapshot(a)
    for exc, idx in [(RefcountError, t([4])), (DoubleFreeError, t([8, 8])),
                     (DoubleFreeError, t([12])), (AlignmentError, t([9]))]:
        with pytest.raises(exc):
            a.free_page_starts(idx)
        assert snapshot(a) == before
    # a free group where page 1 is dropped twice (two holders) and page 2 once
    a.free_group_begin()
    a.free_page_starts(t([4, 8]), shared=True)
    a.free_page_starts(t([4]), shared=True)
    assert a.available_size() == 14 * 4  # nothing released before the group ends
    with pytest.raises(DoubleFreeError):
        a.free_page_starts(t([4]), shared=True)  # count already 0 (queued)
    a.free_group_end()  # shared frees in a group are resolved here, in first-listed order
    assert a.free_pages()[:2].tolist() == [1, 2] and a.available_size() == a.size
    a.check_integrity(holders=[])
    with pytest.raises(DoubleFreeError):
        a.free(x)


def test_free_drops_one_holder_per_page_and_double_free_raises():
    a = PagedTokenToKVPoolAllocator(64, 4)
    x = a.alloc(8)
    a.share(x[::4])
    a.free(x[:6])  # pages 1, 2 (page 2's first slot listed): each drops one holder
    assert a.refcounts()[1:3].tolist() == [1, 1] and a.available_size() == 14 * 4
    a.free(x)
    assert a.available_size() == a.size
    with pytest.raises(DoubleFreeError):
        a.free(x)
    a.check_integrity(holders=[])


def test_check_integrity_with_holders_names_the_wrong_pages():
    a = PagedTokenToKVPoolAllocator(64, 4)
    x = a.alloc(8)
    a.share(t([4]))
    a.check_integrity(holders=[x, x[:2]])
    with pytest.raises(IntegrityError, match=r"pages \[1\]"):
        a.check_integrity(holders=[x])
    with pytest.raises(IntegrityError, match="more than once"):
        a.check_integrity(holders=[x, t([4, 4])])
    with pytest.raises(IntegrityError, match="free and held"):
        a.check_integrity(holders=[x, x[:2], t([12])])
    a.book.refcount[3] = 1  # a free page with a count
    with pytest.raises(IntegrityError, match="free pages with nonzero refcount"):
        a.check_integrity()
    a.book.refcount[3] = 0
    a.book.refcount[2] = 0  # a handed-out page nobody references
    with pytest.raises(IntegrityError, match="leaked"):
        a.check_integrity()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_row_page_starts_matches_a_per_page_reference(ps):
    """Random rows and lengths (zeros, whole pages, partial pages, one row listed twice)."""
    from edserve.mem_cache.req_to_token import ReqToTokenPool

    gen = torch.Generator().manual_seed(ps)
    rtp = ReqToTokenPool(6, 64, "cpu")
    rtp.req_to_token.copy_(torch.randint(0, 10_000, rtp.req_to_token.shape, generator=gen,
                                         dtype=rtp.req_to_token.dtype))
    for _ in range(20):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        rows = torch.randint(0, 6, (n,), generator=gen).tolist()
        lengths = torch.randint(0, 65, (n,), generator=gen).tolist()
        if n % 2:  # a beam group's rows: one length for all
            lengths = [lengths[0]] * n
        want = [int(rtp.req_to_token[r, c]) for r, n_ in zip(rows, lengths, strict=True)
                for c in range(0, n_, ps)]
        got = row_page_starts(rtp, rows, lengths, ps)
        assert got.dtype == torch.int64 and got.tolist() == want
