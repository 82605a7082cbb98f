"""TokenToKVPoolAllocator and the free-list contract shared by both allocators."""

import pytest
import torch

from edserve.mem_cache import (
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVCacheError,
    PagedTokenToKVPoolAllocator,
    ReservedSlotError,
    TokenToKVPoolAllocator,
)

from ._helpers import snapshot, t


def make(kind: str, num_pages: int = 8):
    if kind == "token":
        return TokenToKVPoolAllocator(num_pages)
    return PagedTokenToKVPoolAllocator(num_pages * 4, 4)


KINDS = ["token", "paged"]


def test_token_alloc_hands_out_distinct_nonzero_slots():
    a = TokenToKVPoolAllocator(8)
    assert a.page_size == 1 and a.size == 8 and a.available_size() == 8
    x = a.alloc(5)
    assert x.dtype == torch.int64 and x.tolist() == [1, 2, 3, 4, 5]
    y = a.alloc(3)
    assert sorted(x.tolist() + y.tolist()) == list(range(1, 9))  # slot 0 never
    assert a.available_size() == 0 and a.num_used() == 8
    assert a.alloc(1) is None
    a.check_integrity(torch.cat([x, y]))


def test_token_lifo_reuse_and_noops():
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(4)
    a.free(x[:2])
    assert a.alloc(2).tolist() == [1, 2]
    assert a.alloc(0).numel() == 0
    before = snapshot(a)
    a.free(torch.empty(0, dtype=torch.int64))
    assert snapshot(a) == before


def test_token_extend_and_decode():
    a = TokenToKVPoolAllocator(16)
    out = a.alloc_extend(t([0, 0]), t([3, 2]), t([-1, -1]), 5)
    assert out.tolist() == [1, 2, 3, 4, 5]
    dec = a.alloc_decode(t([4, 3]), t([3, 5]))
    assert dec.tolist() == [6, 7]
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend(t([0]), t([3]), t([-1]), 4)
    with pytest.raises(ValueError, match="prefix_len"):
        a.alloc_extend(t([4]), t([3]), t([7]), 0)
    assert a.available_size() == 9
    before = snapshot(a)
    assert a.alloc_extend(t([0]), t([10]), t([-1]), 10) is None
    assert a.alloc_decode(t(list(range(1, 11))), t([-1] + list(range(1, 10)))) is None
    assert snapshot(a) == before
    a.check_integrity(torch.cat([out, dec]))


def test_token_size_must_hold_a_slot():
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(0)


@pytest.mark.parametrize("kind", KINDS)
def test_free_misuse_raises_before_mutating(kind):
    a = make(kind)
    ps = a.page_size
    x = a.alloc(4 * ps)  # pages 1..4
    a.free(x[:ps])  # page 1 free again
    before = snapshot(a)
    end = (a.num_pages + 1) * ps
    cases = [
        (DoubleFreeError, x[:ps]),  # already free
        (DoubleFreeError, torch.cat([x[ps : 2 * ps], x[ps : 2 * ps]])),  # listed twice
        (ReservedSlotError, t([0])),
        (ReservedSlotError, torch.cat([x[ps : 2 * ps], t([0])])),
        (IndexOutOfRangeError, t([end])),
        (IndexOutOfRangeError, t([-1])),
    ]
    for exc, idx in cases:
        with pytest.raises(exc):
            a.free(idx)
        assert snapshot(a) == before
    with pytest.raises(ValueError):
        a.free(torch.tensor([float(ps)]))
    assert snapshot(a) == before
    a.check_integrity(x[ps:])


@pytest.mark.parametrize("kind", KINDS)
def test_free_group_batches_frees(kind):
    a = make(kind)
    ps = a.page_size
    x = a.alloc(3 * ps)
    a.free_group_begin()
    a.free(x[:ps])
    a.free(x[ps : 2 * ps])
    assert a.available_size() == (a.num_pages - 3) * ps  # nothing released yet
    with pytest.raises(DoubleFreeError):
        a.free(x[:ps])  # already queued in this group
    with pytest.raises(KVCacheError, match="nest"):
        a.free_group_begin()
    with pytest.raises(IntegrityError, match="free group"):
        a.check_integrity()
    a.free_group_end()
    assert a.available_size() == (a.num_pages - 1) * ps
    with pytest.raises(KVCacheError, match="without"):
        a.free_group_end()
    a.free_group_begin()
    a.free_group_end()  # empty group is fine
    a.check_integrity(x[2 * ps :])
    a.free(x[2 * ps :])
    a.check_integrity(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == a.size


@pytest.mark.parametrize("kind", KINDS)
def test_check_integrity_detects_leaks_and_corruption(kind):
    a = make(kind)
    ps = a.page_size
    x = a.alloc(3 * ps)
    a.check_integrity(x)
    a.check_integrity()  # without owners: only the free list is checked
    with pytest.raises(IntegrityError, match=r"1 leaked"):
        a.check_integrity(x[ps:])
    with pytest.raises(IntegrityError, match="owned twice"):
        a.check_integrity(torch.cat([x, x[:1]]))
    y = a.alloc(ps)
    a.free(y)
    with pytest.raises(IntegrityError, match="both free and owned"):
        a.check_integrity(torch.cat([x, y]))
    with pytest.raises(IntegrityError, match="outside"):
        a.check_integrity(torch.cat([x, t([0])]))
    a.book.free_pages = torch.cat([a.book.free_pages, a.book.free_pages[:1]])
    with pytest.raises(IntegrityError, match="twice"):
        a.check_integrity(x)
    a.book.free_pages = torch.cat([t([0]), a.book.free_pages[:-1]])
    with pytest.raises(IntegrityError, match="page 0"):
        a.check_integrity(x)
