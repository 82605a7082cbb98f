"""Property-based: random interleavings of extend / decode / free over many requests.

The test keeps a model (``Req.slots``: the true slot of every position of each live request)
and after every step checks the invariants the attention kernels rely on.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edserve.mem_cache import (
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    alloc_for_extend,
    page_table_from_req_to_token,
)

from ._helpers import Req, snapshot, t

EMPTY = torch.empty(0, dtype=torch.int64)

CASES = [("token", 1), ("paged", 1), ("paged", 4), ("paged", 16), ("paged", 64), ("paged", 128)]


def check_invariants(pool: ReqToTokenPool, alloc, live: list[Req]) -> None:
    ps = alloc.page_size
    owned = t([s for r in live for s in r.slots])
    # no slot owned twice, and no page shared by two requests
    assert owned.unique().numel() == owned.numel()
    pages_per_req = [set((t(r.slots) // ps).tolist()) for r in live]
    assert sum(map(len, pages_per_req)) == len(set().union(*pages_per_req))
    for r in live:
        n = len(r.slots)
        slots = t(r.slots)
        assert pool.req_to_token[r.req_pool_idx, :n].tolist() == r.slots
        pos = torch.arange(n)
        # contiguous and ordered within each page: position t sits at offset t % ps of the
        # page holding position t - t % ps
        assert torch.equal(slots % ps, pos % ps)
        assert torch.equal(slots[pos - pos % ps] // ps, slots // ps)
    if live:
        rows = t([r.req_pool_idx for r in live])
        pt = page_table_from_req_to_token(pool.req_to_token, ps, rows=rows).long()
        for i, r in enumerate(live):
            pos = torch.arange(len(r.slots))
            assert torch.equal(pt[i, pos // ps] * ps + pos % ps, t(r.slots))
    alloc.check_integrity(owned)
    pool.check_integrity(num_held=len(live))
    num_owned_pages = sum(map(len, pages_per_req))
    assert alloc.available_size() == alloc.size - num_owned_pages * ps


def make(kind: str, ps: int, num_pages: int):
    if kind == "token":
        return TokenToKVPoolAllocator(num_pages)
    return PagedTokenToKVPoolAllocator(num_pages * ps, ps)


def draw_extend_len(data, prefix: int, lo: int, max_ctx: int, ps: int) -> int:
    """New tokens for a request at ``prefix``: uniform, or ending right around a page edge."""
    room = max_ctx - prefix
    edge = -(-(prefix + 1) // ps) * ps - prefix + data.draw(st.sampled_from([-1, 0, 1]))
    near_edge = min(max(edge, lo), room)
    return data.draw(st.one_of(st.integers(lo, room), st.just(near_edge)), label="new tokens")


@pytest.mark.parametrize("kind,ps", CASES)
@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_extend_decode_free(kind, ps, data):
    # context: a few pages (at least 24 tokens at page size 1); pool: 1.5..4 contexts
    max_ctx = max(24, ps * data.draw(st.integers(2, 4), label="pages per context"))
    num_pages = max_ctx // ps * data.draw(st.sampled_from([1.5, 2, 4]), label="contexts")
    pool = ReqToTokenPool(size=data.draw(st.integers(2, 6), label="rows"), max_context_len=max_ctx)
    alloc = make(kind, ps, int(num_pages))
    live: list[Req] = []

    for _ in range(data.draw(st.integers(4, 20), label="steps")):
        op = data.draw(st.sampled_from(["extend", "extend", "decode", "free"]))
        before = (snapshot(alloc), list(pool._free_rows), pool.req_to_token.clone())
        if op == "extend":
            cont = [r for r in live if data.draw(st.booleans())]
            new = [Req() for _ in range(data.draw(st.integers(0 if cont else 1, 3)))]
            reqs = cont + new
            prefix = [len(r.slots) for r in reqs]
            seq = [
                p + draw_extend_len(data, p, 0 if r in cont else 1, max_ctx, ps)
                for p, r in zip(prefix, reqs, strict=True)
            ]
            prefixes = [pool.req_to_token[r.req_pool_idx, : len(r.slots)] for r in cont]
            prefixes += [EMPTY] * len(new)
            res = alloc_for_extend(pool, alloc, reqs, t(prefix), t(seq), prefixes)
            event(f"extend {'short' if res is None else 'ok'}, {len(cont)} continuing")
            if res is None:
                assert all(r.req_pool_idx is None for r in new)
                assert before[:2] == (snapshot(alloc), list(pool._free_rows))
                assert torch.equal(pool.req_to_token, before[2])
            else:
                rows, loc = res
                assert rows.tolist() == [r.req_pool_idx for r in reqs]
                off = 0
                for r, p, s in zip(reqs, prefix, seq, strict=True):
                    r.slots += loc[off : off + s - p].tolist()
                    off += s - p
                assert off == loc.numel()
                live += new
        elif op == "decode":
            batch = [r for r in live if data.draw(st.booleans())]
            for _ in range(data.draw(st.integers(1, 3), label="decode rounds")):
                batch = [r for r in batch if len(r.slots) < max_ctx]
                if not batch:
                    break
                seq = t([len(r.slots) + 1 for r in batch])
                last = t([r.slots[-1] for r in batch])
                before_round = snapshot(alloc)
                out = alloc.alloc_decode(seq, last)
                new_page = bool(((seq - 1) % ps == 0).any())
                event(f"decode {'short' if out is None else 'ok'}, new page: {new_page}")
                if out is None:
                    assert before_round == snapshot(alloc)
                    break
                for r, slot in zip(batch, out.tolist(), strict=True):
                    pool.write(r.req_pool_idx, len(r.slots), t([slot]))
                    r.slots.append(slot)
        elif live:
            r = live.pop(data.draw(st.integers(0, len(live) - 1)))
            alloc.free(pool.req_to_token[r.req_pool_idx, : len(r.slots)])
            pool.free(r)
        check_invariants(pool, alloc, live)

    # freeing everything (as one free group) restores the full free count
    alloc.free_group_begin()
    for r in live:
        alloc.free(pool.req_to_token[r.req_pool_idx, : len(r.slots)])
        pool.free(r)
    alloc.free_group_end()
    assert alloc.available_size() == alloc.size
    assert pool.available_size() == pool.size
    check_invariants(pool, alloc, [])
