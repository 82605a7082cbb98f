import pytest
import torch

from edserve.mem_cache import (
    ContextOverflowError,
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVCacheError,
    ReqToTokenPool,
    ReservedSlotError,
)

from ._helpers import Req, t


def test_shape_dtype_and_padding_row():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (4, 8)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.size == 3 and pool.max_context_len == 8
    assert pool.available_size() == 3
    rows = pool.alloc([Req(), Req(), Req()])
    assert sorted(rows) == [1, 2, 3]  # row 0 is never handed out
    assert pool.available_size() == 0
    pool.check_integrity(num_held=3)


def test_alloc_sets_rows_in_request_order_and_lifo_reuse():
    pool = ReqToTokenPool(size=4, max_context_len=8)
    a, b, c = Req("a"), Req("b"), Req("c")
    assert pool.alloc([a, b, c]) == [1, 2, 3]
    assert (a.req_pool_idx, b.req_pool_idx, c.req_pool_idx) == (1, 2, 3)
    pool.free(a)
    pool.free(c)
    assert a.req_pool_idx is None and c.req_pool_idx is None
    d, e = Req("d"), Req("e")
    assert pool.alloc([d, e]) == [3, 1]  # last freed, first reused
    pool.check_integrity(num_held=3)


def test_generation_counts_the_holds_of_each_row():
    """(row, generation) names one request's hold: a new hold of a row bumps it; keeping a row
    (chunked prefill), freeing it and a shortage do not."""
    pool = ReqToTokenPool(size=2, max_context_len=8)
    a, b = Req("a"), Req("b")
    pool.alloc([a, b])
    assert pool.generation == [0, 1, 1]
    pool.alloc([a])  # still held: the same hold
    pool.free(a)
    assert pool.generation == [0, 1, 1]
    assert pool.alloc([Req(), Req()]) is None  # shortage: nothing changes
    c = Req("c")
    assert pool.alloc([c]) == [1] and pool.generation == [0, 2, 1]


def test_request_holding_a_row_keeps_it_and_uses_no_free_row():
    pool = ReqToTokenPool(size=2, max_context_len=8)
    a, b = Req(), Req()
    pool.alloc([a, b])
    assert pool.available_size() == 0
    assert pool.alloc([b, a]) == [2, 1]  # chunked prefill: both keep their rows
    assert pool.available_size() == 0
    pool.check_integrity(num_held=2)


def test_shortage_returns_none_and_mutates_nothing():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    held = Req()
    pool.alloc([held])
    free_before = list(pool._free_rows)
    new = [Req(), Req(), Req()]
    assert pool.alloc([held, *new]) is None
    assert all(r.req_pool_idx is None for r in new)
    assert held.req_pool_idx == 1
    assert pool._free_rows == free_before
    pool.check_integrity(num_held=1)


def test_alloc_empty_list():
    pool = ReqToTokenPool(size=1, max_context_len=4)
    assert pool.alloc([]) == []
    assert pool.available_size() == 1


def test_free_misuse_raises_specific_errors_and_keeps_state():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    a = Req()
    pool.alloc([a])
    pool.free(a)
    with pytest.raises(DoubleFreeError):
        pool.free(a)  # req_pool_idx is None now
    stale = Req()
    stale.req_pool_idx = 1  # row 1 is free
    with pytest.raises(DoubleFreeError):
        pool.free(stale)
    zero = Req()
    zero.req_pool_idx = 0
    with pytest.raises(ReservedSlotError):
        pool.free(zero)
    far = Req()
    far.req_pool_idx = 4
    with pytest.raises(IndexOutOfRangeError):
        pool.free(far)
    assert pool.available_size() == 3
    pool.check_integrity(num_held=0)


def test_alloc_misuse():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    a = Req()
    with pytest.raises(ValueError):
        pool.alloc([a, a])
    assert a.req_pool_idx is None
    claims_free = Req()
    claims_free.req_pool_idx = 2
    with pytest.raises(IntegrityError):
        pool.alloc([Req(), claims_free])
    claims_zero = Req()
    claims_zero.req_pool_idx = 0
    with pytest.raises(ReservedSlotError):
        pool.alloc([claims_zero])
    assert pool.available_size() == 3
    pool.check_integrity(num_held=0)


def test_write_and_context_overflow():
    pool = ReqToTokenPool(size=2, max_context_len=6)
    a = Req()
    (row,) = pool.alloc([a])
    pool.write(row, 0, t([10, 11, 12]))
    pool.write(row, 3, t([13, 14, 15]))  # ends exactly at max_context_len
    assert pool.req_to_token[row].tolist() == [10, 11, 12, 13, 14, 15]
    before = pool.req_to_token.clone()
    with pytest.raises(ContextOverflowError):
        pool.write(row, 4, t([1, 2, 3]))
    with pytest.raises(ContextOverflowError):
        pool.write(row, 6, t([1]))
    with pytest.raises(ReservedSlotError):
        pool.write(0, 0, t([1]))
    with pytest.raises(KVCacheError):
        pool.write(2, 0, t([1]))  # row 2 is not held
    with pytest.raises(IndexOutOfRangeError):
        pool.write(row, -1, t([1]))
    with pytest.raises(ValueError):
        pool.write(row, 0, torch.tensor([1.0]))
    assert torch.equal(pool.req_to_token, before)
    pool.check_integrity(num_held=1)


def test_check_integrity_reports_leaks_and_corruption():
    pool = ReqToTokenPool(size=3, max_context_len=4)
    pool.alloc([Req(), Req()])
    with pytest.raises(IntegrityError, match="1 row\\(s\\) leaked"):
        pool.check_integrity(num_held=1)
    with pytest.raises(IntegrityError, match="over-counted"):
        pool.check_integrity(num_held=3)
    pool._free_rows.append(3)  # corrupt: row 3 twice
    with pytest.raises(IntegrityError, match="twice"):
        pool.check_integrity(num_held=1)
    pool._free_rows[-1] = 0
    with pytest.raises(IntegrityError, match="row 0"):
        pool.check_integrity(num_held=1)


def test_constructor_validation():
    with pytest.raises(ValueError):
        ReqToTokenPool(size=0, max_context_len=4)
    with pytest.raises(ValueError):
        ReqToTokenPool(size=1, max_context_len=0)
