"""write_cache_indices (torch path) and alloc_for_extend."""

import pytest
import torch

from edserve.mem_cache import (
    ContextOverflowError,
    IndexOutOfRangeError,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    ReservedSlotError,
    TokenToKVPoolAllocator,
    alloc_for_extend,
    write_cache_indices,
)
from edserve.mem_cache.allocation import _resolve_use_triton

from ._helpers import Req, snapshot, t

EMPTY = torch.empty(0, dtype=torch.int64)


def test_write_cache_indices_rows_are_prefix_then_new_slots():
    r2t = torch.full((4, 8), -7, dtype=torch.int32)
    write_cache_indices(
        r2t,
        req_pool_indices=t([3, 1, 2]),
        prefix_lens=t([2, 0, 3]),
        seq_lens=t([5, 2, 3]),
        prefix_tensors=[t([40, 41]), EMPTY, torch.tensor([7, 8, 9], dtype=torch.int32)],
        out_cache_loc=t([10, 11, 12, 20, 21]),
        use_triton=False,
    )
    assert r2t[3].tolist() == [40, 41, 10, 11, 12, -7, -7, -7]
    assert r2t[1].tolist() == [20, 21] + [-7] * 6
    assert r2t[2].tolist() == [7, 8, 9] + [-7] * 5
    assert r2t[0].tolist() == [-7] * 8  # untouched


def test_write_cache_indices_misuse_writes_nothing():
    r2t = torch.zeros((4, 6), dtype=torch.int32)

    def call(rows=(1,), prefix=(1,), seq=(3,), prefixes=None, loc=None):
        prefixes = (t([5]),) if prefixes is None else prefixes
        loc = t([6, 7]) if loc is None else loc
        write_cache_indices(
            r2t, t(list(rows)), t(list(prefix)), t(list(seq)), list(prefixes), loc, use_triton=False
        )

    with pytest.raises(ContextOverflowError, match="7"):
        call(seq=(7,), loc=t([1, 2, 3, 4, 5, 6]))
    with pytest.raises(ValueError, match="prefix_tensors"):
        call(prefixes=(t([5, 6]),))
    with pytest.raises(ValueError, match="out_cache_loc"):
        call(loc=t([6]))
    with pytest.raises(ValueError, match="prefix_len <= seq_len"):
        call(prefix=(4,), prefixes=(t([1, 2, 3, 4]),), loc=EMPTY)
    with pytest.raises(ReservedSlotError):
        call(rows=(0,))
    with pytest.raises(IndexOutOfRangeError):
        call(rows=(4,))
    with pytest.raises(ValueError, match="twice"):
        call(rows=(1, 1), prefix=(0, 0), seq=(1, 1), prefixes=(EMPTY, EMPTY))
    with pytest.raises(ValueError, match="batch size"):
        call(prefixes=())
    assert r2t.abs().sum() == 0


def test_default_backend_is_torch_on_cpu():
    assert _resolve_use_triton(None, torch.device("cpu")) is False
    assert _resolve_use_triton(True, torch.device("cpu")) is True


@pytest.mark.parametrize("ps", [1, 4])
def test_alloc_for_extend_then_chunked_continuation(ps):
    pool = ReqToTokenPool(size=4, max_context_len=16)
    alloc = TokenToKVPoolAllocator(32) if ps == 1 else PagedTokenToKVPoolAllocator(32, ps)
    a, b = Req(), Req()
    rows, loc = alloc_for_extend(pool, alloc, [a, b], t([0, 0]), t([3, 6]), [EMPTY, EMPTY])
    assert rows.tolist() == [a.req_pool_idx, b.req_pool_idx] == [1, 2]
    assert loc.numel() == 9
    assert pool.req_to_token[1, :3].tolist() == loc[:3].tolist()
    assert pool.req_to_token[2, :6].tolist() == loc[3:].tolist()
    # chunked prefill: a continues from its own row (prefix = its first 3 slots), c is new
    c = Req()
    prefix_a = pool.req_to_token[1, :3]
    rows2, loc2 = alloc_for_extend(pool, alloc, [a, c], t([3, 0]), t([7, 2]), [prefix_a, EMPTY])
    assert rows2.tolist() == [1, 3]
    row_a = pool.req_to_token[1, :7]
    assert row_a[:3].tolist() == loc[:3].tolist() and row_a[3:].tolist() == loc2[:4].tolist()
    assert torch.equal(row_a.long() % ps, torch.arange(7) % ps)  # page offsets follow positions
    owned = torch.cat([row_a, pool.req_to_token[2, :6], pool.req_to_token[3, :2]])
    alloc.check_integrity(owned)
    pool.check_integrity(num_held=3)


def test_alloc_for_extend_slot_shortage_returns_rows():
    pool = ReqToTokenPool(size=4, max_context_len=32)
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    held = Req()
    alloc_for_extend(pool, alloc, [held], t([0]), t([5]), [EMPTY])
    rows_before, slots_before = list(pool._free_rows), snapshot(alloc)
    r2t_before = pool.req_to_token.clone()
    new = [Req(), Req()]
    prefix = pool.req_to_token[held.req_pool_idx, :5]
    # needs 1 page for `held` + 2 for the new ones; only 2 are free
    out = alloc_for_extend(
        pool, alloc, [held, *new], t([5, 0, 0]), t([9, 4, 4]), [prefix, EMPTY, EMPTY]
    )
    assert out is None
    assert all(r.req_pool_idx is None for r in new) and held.req_pool_idx == 1
    assert pool._free_rows == rows_before and snapshot(alloc) == slots_before
    assert torch.equal(pool.req_to_token, r2t_before)
    pool.check_integrity(num_held=1)
    alloc.check_integrity(prefix)


def test_alloc_for_extend_row_shortage_and_misuse():
    pool = ReqToTokenPool(size=1, max_context_len=8)
    alloc = TokenToKVPoolAllocator(32)
    before = snapshot(alloc)
    assert (
        alloc_for_extend(pool, alloc, [Req(), Req()], t([0, 0]), t([1, 1]), [EMPTY, EMPTY]) is None
    )
    r = Req()
    with pytest.raises(ContextOverflowError):
        alloc_for_extend(pool, alloc, [r], t([0]), t([9]), [EMPTY])
    with pytest.raises(ValueError):
        alloc_for_extend(pool, alloc, [r], t([1]), t([3]), [EMPTY])
    with pytest.raises(ValueError):
        alloc_for_extend(pool, alloc, [r, Req()], t([0]), t([3]), [EMPTY])
    assert r.req_pool_idx is None and pool.available_size() == 1
    assert snapshot(alloc) == before
    pool.check_integrity(num_held=0)
    alloc.check_integrity(EMPTY)


def test_alloc_for_extend_undoes_rows_when_allocator_raises():
    pool = ReqToTokenPool(size=2, max_context_len=8)
    alloc = PagedTokenToKVPoolAllocator(32, 4)
    r = Req()
    # a prefix slot on a page that was never handed out: the allocator refuses
    with pytest.raises(Exception, match="handed-out"):
        alloc_for_extend(pool, alloc, [r], t([1]), t([3]), [t([12])])
    assert r.req_pool_idx is None and pool.available_size() == 2
    pool.check_integrity(num_held=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ps", [1, 16, 128])
def test_cuda_pools_and_default_triton_writer(ps):
    dev = torch.device("cuda")
    pool = ReqToTokenPool(size=8, max_context_len=4 * ps + 8, device=dev)
    alloc = (
        TokenToKVPoolAllocator(64, dev)
        if ps == 1
        else PagedTokenToKVPoolAllocator(64 * ps, ps, dev)
    )
    reqs = [Req() for _ in range(5)]
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    seq = t([1, ps, ps + 1, 2 * ps + 3, 3]).to(dev)
    rows, loc = alloc_for_extend(pool, alloc, reqs, torch.zeros_like(seq), seq, [empty] * 5)
    assert _resolve_use_triton(None, dev) is True
    expect = torch.zeros_like(pool.req_to_token)
    write_cache_indices(
        expect, rows, torch.zeros_like(seq), seq, [empty] * 5, loc, use_triton=False
    )
    assert torch.equal(pool.req_to_token, expect)
    # decode one token for everyone, then free all
    last = pool.req_to_token[rows, seq - 1].long()
    dec = alloc.alloc_decode(seq + 1, last)
    pool.req_to_token[rows, seq] = dec.int()
    owned = torch.cat([pool.req_to_token[r, : int(s) + 1] for r, s in zip(rows, seq, strict=True)])
    alloc.check_integrity(owned)
    alloc.free(owned)
    assert alloc.available_size() == alloc.size
