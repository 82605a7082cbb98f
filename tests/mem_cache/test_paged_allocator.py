"""PagedTokenToKVPoolAllocator: exact page layouts, shortage, misuse."""

import pytest
import torch

from edserve.mem_cache import (
    AlignmentError,
    DoubleFreeError,
    KVCacheError,
    PagedTokenToKVPoolAllocator,
    ReservedSlotError,
)

from ._helpers import snapshot, t


def test_pages_and_page_zero():
    a = PagedTokenToKVPoolAllocator(32, 4)
    assert (a.size, a.page_size, a.num_pages, a.available_size()) == (32, 4, 8, 32)
    x = a.alloc(8)
    assert x.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # pages 1, 2; page 0 never
    assert a.available_size() == 24 and a.num_used() == 8
    assert PagedTokenToKVPoolAllocator(30, 4).size == 28  # floored to whole pages


def test_unaligned_alloc_raises():
    a = PagedTokenToKVPoolAllocator(32, 4)
    before = snapshot(a)
    with pytest.raises(AlignmentError):
        a.alloc(5)
    with pytest.raises(ValueError):
        a.alloc(-4)
    assert snapshot(a) == before


def test_extend_fills_partial_page_then_whole_pages_then_tail():
    # page size 4, prefix 2 -> seq 11: tokens 2..3 finish the prefix's page, 4..7 take one
    # whole new page, 8..10 a tail page holding 3 tokens.
    a = PagedTokenToKVPoolAllocator(64, 4)
    prefix = a.alloc_extend(t([0]), t([2]), t([-1]), 2)
    assert prefix.tolist() == [4, 5]  # page 1
    out = a.alloc_extend(t([2]), t([11]), t([5]), 9)
    assert out.tolist() == [6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert (out[:2] // 4).tolist() == [1, 1]  # the prefix's last page
    assert (out[2:6] // 4).tolist() == [2] * 4  # one whole new page
    assert (out[6:] // 4).tolist() == [3] * 3  # tail page, 3 tokens
    assert a.available_size() == 64 - 3 * 4
    a.check_integrity(torch.cat([prefix, out]))


def test_extend_batch_layout_in_request_order():
    a = PagedTokenToKVPoolAllocator(64, 4)
    held = a.alloc(4)  # page 1 taken by someone else
    first = a.alloc_extend(t([0, 0]), t([3, 5]), t([-1, -1]), 8)
    # req 0 -> page 2 (3 tokens); req 1 -> pages 3, 4 (4 + 1 tokens)
    assert first.tolist() == [8, 9, 10, 12, 13, 14, 15, 16]
    # continue: req 0 (len 3, last 10) by 6 tokens; req 1 (len 5, last 16) by 3; a new req by 4
    out = a.alloc_extend(t([3, 5, 0]), t([9, 8, 4]), t([10, 16, -1]), 13)
    assert out.tolist() == [
        11, 20, 21, 22, 23, 24,  # req 0: finish page 2, new page 5, tail page 6
        17, 18, 19,  # req 1: stays on its page 4
        28, 29, 30, 31,  # new req: page 7
    ]  # fmt: skip
    a.check_integrity(torch.cat([held, first, out]))


def test_extend_from_page_aligned_prefix_and_within_partial_page():
    a = PagedTokenToKVPoolAllocator(64, 4)
    p = a.alloc_extend(t([0]), t([4]), t([-1]), 4)
    assert p.tolist() == [4, 5, 6, 7]
    out = a.alloc_extend(t([4]), t([6]), t([7]), 2)  # aligned prefix: straight to a new page
    assert out.tolist() == [8, 9]
    avail = a.available_size()
    out2 = a.alloc_extend(t([6]), t([7]), t([9]), 1)  # fits the partial page: no new page
    assert out2.tolist() == [10] and a.available_size() == avail
    empty = a.alloc_extend(t([7]), t([7]), t([10]), 0)
    assert empty.numel() == 0 and a.available_size() == avail


def test_decode_takes_new_page_exactly_at_boundary():
    ps = 4
    a = PagedTokenToKVPoolAllocator(64, ps)
    slots = a.alloc_extend(t([0]), t([3]), t([-1]), 3).tolist()
    for seq_len in range(4, 14):
        avail = a.available_size()
        (slot,) = a.alloc_decode(t([seq_len]), t([slots[-1]])).tolist()
        new_page = (seq_len - 1) % ps == 0
        assert (a.available_size() == avail - ps) == new_page
        assert slot % ps == (seq_len - 1) % ps
        if not new_page:
            assert slot == slots[-1] + 1
        slots.append(slot)
    assert slots[:4] == [4, 5, 6, 7] and slots[4:8] == [8, 9, 10, 11] and slots[12] == 16
    a.check_integrity(t(slots))


def test_decode_first_token_and_batch():
    a = PagedTokenToKVPoolAllocator(64, 4)
    x = a.alloc_extend(t([0]), t([2]), t([-1]), 2)  # [4, 5]
    dec = a.alloc_decode(t([1, 3, 1]), t([-1, 5, -1]))
    assert dec.tolist() == [8, 6, 12]
    a.check_integrity(torch.cat([x, dec]))


def test_shortage_returns_none_and_leaves_state_untouched():
    a = PagedTokenToKVPoolAllocator(16, 4)  # 4 pages
    x = a.alloc_extend(t([0]), t([10]), t([-1]), 10)  # 3 pages, tail page holds 2
    before = snapshot(a)
    assert a.alloc(8) is None
    assert a.alloc_extend(t([0, 0]), t([4, 1]), t([-1, -1]), 5) is None  # needs 2 pages
    assert a.alloc_decode(t([1, 1]), t([-1, -1])) is None
    assert snapshot(a) == before
    # but a request that stays on its partial page needs no new page
    assert a.alloc_extend(t([10]), t([12]), t([int(x[-1])]), 2).tolist() == [14, 15]


def test_free_releases_distinct_pages_including_partial_tail():
    a = PagedTokenToKVPoolAllocator(32, 4)
    x = a.alloc_extend(t([0]), t([6]), t([-1]), 6)  # page 1 full, page 2 holds 2 tokens
    assert x.tolist() == [4, 5, 6, 7, 8, 9]
    a.free(x)
    assert a.available_size() == 32
    assert a.free_pages()[:2].tolist() == [1, 2]  # prepended: reused first (LIFO)
    a.check_integrity(torch.empty(0, dtype=torch.int64))


def test_free_misuse_paged():
    a = PagedTokenToKVPoolAllocator(32, 4)
    x = a.alloc(8)  # pages 1, 2 = slots 4..11
    before = snapshot(a)
    with pytest.raises(AlignmentError, match="partial-page"):
        a.free(t([6, 7]))  # page 1 without its first slot
    with pytest.raises(AlignmentError):
        a.free(t([4, 5, 9]))  # page 2 without slot 8
    with pytest.raises(ReservedSlotError):
        a.free(t([3]))  # page 0
    a.free(t([8, 9]))  # first slot listed: the whole page 2 goes back
    with pytest.raises(DoubleFreeError):
        a.free(t([8]))
    assert snapshot(a)[0] == [2] + before[0]
    a.check_integrity(x[:4])


def test_extend_and_decode_misuse():
    a = PagedTokenToKVPoolAllocator(32, 4)
    x = a.alloc_extend(t([0]), t([2]), t([-1]), 2)  # [4, 5]
    before = snapshot(a)
    with pytest.raises(AlignmentError, match="last_loc"):
        a.alloc_extend(t([2]), t([4]), t([6]), 2)  # last_loc should be 5
    with pytest.raises(AlignmentError, match="last_loc"):
        a.alloc_extend(t([0]), t([4]), t([0]), 4)  # empty prefix needs last_loc -1
    with pytest.raises(KVCacheError, match="handed-out"):
        a.alloc_extend(t([2]), t([4]), t([9]), 2)  # page 2 is free
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend(t([2]), t([4]), t([5]), 3)
    with pytest.raises(ValueError, match="same length"):
        a.alloc_extend(t([2]), t([4, 5]), t([5]), 2)
    with pytest.raises(AlignmentError, match="last_loc"):
        a.alloc_decode(t([3]), t([4]))  # position 1 is slot 5
    with pytest.raises(AlignmentError):
        a.alloc_decode(t([1]), t([5]))  # first token needs last_loc -1
    with pytest.raises(ValueError):
        a.alloc_decode(t([0]), t([-2]))
    with pytest.raises(KVCacheError, match="handed-out"):
        a.alloc_decode(t([3]), t([9]))
    with pytest.raises(ValueError, match="integer"):
        a.alloc_decode(torch.tensor([3.0]), t([5]))
    assert snapshot(a) == before
    a.check_integrity(x)


@pytest.mark.parametrize("ps", [16, 64, 128])
def test_extend_layout_large_pages(ps):
    a = PagedTokenToKVPoolAllocator(16 * ps, ps)
    pre = a.alloc_extend(t([0]), t([ps + 3]), t([-1]), ps + 3)
    out = a.alloc_extend(t([ps + 3]), t([3 * ps + 5]), t([int(pre[-1])]), 2 * ps + 2)
    slots = torch.cat([pre, out])
    pos = torch.arange(slots.numel())
    assert torch.equal(slots % ps, pos % ps)
    pages = slots // ps
    assert torch.equal(pages[pos - pos % ps], pages)  # one page per ps-block of positions
    assert pages.unique().numel() == 4
    a.check_integrity(slots)
