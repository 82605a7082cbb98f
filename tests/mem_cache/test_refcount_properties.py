"""Property-based: random interleavings of alloc / fork / write (with copy-on-write) / free
over rows that share pages.

A real 1-layer ``KVPool`` (1 head, head_dim 1, float32) stores each token's value (K = value,
V = -value). The model is the list of token values of every live row; after every step each
row read back through its page table must equal the model (so copy-on-write never changes a
sibling's view), and ``check_integrity(holders=rows)`` must pass (counts == holders, no page
free while held, none leaked). At the end everything is freed: all pages free, counts 0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edserve.mem_cache import (
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    cow_last_pages,
    fork_row,
    page_table_from_req_to_token,
)

from ._helpers import Req, snapshot, t


class World:
    def __init__(self, ps: int, num_pages: int, rows: int, max_ctx: int):
        self.ps, self.max_ctx = ps, max_ctx
        self.alloc = (TokenToKVPoolAllocator(num_pages) if ps == 1
                      else PagedTokenToKVPoolAllocator(num_pages * ps, ps))
        self.rtp = ReqToTokenPool(rows, max_ctx)
        self.kv = KVPool(num_pages * ps, ps, 1, 1, 1)
        self.live: list[Req] = []
        self.counter = 0.0

    def row_slots(self, r: Req) -> torch.Tensor:
        return self.rtp.req_to_token[r.req_pool_idx, : len(r.slots)].long()

    def store(self, r: Req, start: int, out: torch.Tensor) -> None:
        vals = torch.arange(1, out.numel() + 1, dtype=torch.float32) + self.counter
        self.counter += out.numel()
        self.kv.set_kv(0, out, vals[:, None, None], -vals[:, None, None])
        self.rtp.write(r.req_pool_idx, start, out)
        r.slots = r.slots[:start] + vals.tolist()

    def grow(self, reqs: list[Req], ks: list[int]) -> str:
        """cow for all of ``reqs``, then ``ks[i]`` new tokens each (decode when all are 1)."""
        rows, lens = [r.req_pool_idx for r in reqs], [len(r.slots) for r in reqs]
        before = (snapshot(self.alloc), self.rtp.req_to_token.clone())
        if not cow_last_pages(self.rtp, self.alloc, self.kv, rows, lens):
            assert snapshot(self.alloc) == before[0]
            assert torch.equal(self.rtp.req_to_token, before[1])
            return "cow short"
        last = t([int(self.rtp.req_to_token[r, n - 1]) if n else -1 for r, n in zip(
            rows, lens, strict=True)])
        seq = [n + k for n, k in zip(lens, ks, strict=True)]
        if all(k == 1 for k in ks):
            out = self.alloc.alloc_decode(t(seq), last)
        else:
            out = self.alloc.alloc_extend(t(lens), t(seq), last, sum(ks))
        if out is None:
            return "alloc short"
        off = 0
        for r, n, k in zip(reqs, lens, ks, strict=True):
            self.store(r, n, out[off : off + k])
            off += k
        return "ok"

    def release(self, reqs: list[Req]) -> None:
        self.alloc.free_group_begin()
        for r in reqs:
            self.alloc.free_page_starts(self.row_slots(r)[:: self.ps], shared=True)
        self.alloc.free_group_end()
        for r in reqs:
            self.rtp.free(r)
            self.live.remove(r)

    def check(self) -> None:
        ps = self.ps
        self.alloc.check_integrity(holders=[self.row_slots(r) for r in self.live])
        self.rtp.check_integrity(num_held=len(self.live))
        if not self.live:
            return
        rows = t([r.req_pool_idx for r in self.live])
        pt = page_table_from_req_to_token(self.rtp.req_to_token, ps, rows=rows).long()
        k, v = self.kv.get_kv(0)
        for i, r in enumerate(self.live):
            pos = torch.arange(len(r.slots))
            slot = pt[i, pos // ps] * ps + pos % ps
            assert k[slot, 0, 0].tolist() == r.slots
            assert v[slot, 0, 0].tolist() == [-x for x in r.slots]


@pytest.mark.parametrize("ps", [1, 4, 16, 64, 128])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_alloc_fork_write_free(ps, data):
    max_ctx = max(24, ps * data.draw(st.integers(2, 4), label="pages per context"))
    num_pages = int(max_ctx // ps * data.draw(st.sampled_from([1.5, 2, 3]), label="contexts"))
    w = World(ps, num_pages, data.draw(st.integers(2, 6), label="rows"), max_ctx)
    near_edge = [ps - 1, ps, ps + 1, 2 * ps - 1]  # lengths around page edges

    for _ in range(data.draw(st.integers(4, 24), label="steps")):
        op = data.draw(st.sampled_from(["alloc", "fork", "fork", "write", "write", "write_many",
                                        "free", "free_two"]))
        if op == "alloc" or not w.live:
            n = data.draw(st.one_of(st.integers(1, max_ctx // 2),
                                    st.sampled_from([x for x in near_edge if x <= max_ctx])))
            r = Req()
            if w.rtp.alloc([r]) is None:
                event("alloc: no row")
                continue
            out = w.alloc.alloc_extend(t([0]), t([n]), t([-1]), n)
            if out is None:
                w.rtp.free(r)
                event("alloc: short")
                continue
            w.live.append(r)
            w.store(r, 0, out)
        elif op == "fork":
            parent = data.draw(st.sampled_from(w.live))
            child = Req()
            before = snapshot(w.alloc)
            row = fork_row(w.rtp, w.alloc, parent.req_pool_idx, child, len(parent.slots))
            if row is None:
                assert snapshot(w.alloc) == before and child.req_pool_idx is None
                event("fork: no row")
                continue
            child.slots = list(parent.slots)
            w.live.append(child)
            event(f"fork at offset {len(parent.slots) % ps == 0 and 'edge' or 'mid-page'}")
        elif op in ("write", "write_many"):
            pick = (st.lists(st.sampled_from(w.live), min_size=1, max_size=4, unique_by=id)
                    if op == "write_many" else st.sampled_from(w.live).map(lambda r: [r]))
            reqs = [r for r in data.draw(pick) if len(r.slots) < max_ctx]
            if not reqs:
                continue
            many = op == "write_many" and data.draw(st.booleans())
            ks = [data.draw(st.integers(1, min(4 if many else 1 + 2 * ps, max_ctx - len(r.slots))))
                  if op == "write" or many else 1 for r in reqs]
            event(f"{op}: {w.grow(reqs, ks)}")
        elif op == "free":
            w.release([data.draw(st.sampled_from(w.live))])
        else:  # two rows (often a parent and its fork) in one free group
            pair = data.draw(st.lists(st.sampled_from(w.live), min_size=1, max_size=2,
                                      unique_by=id))
            w.release(pair)
        w.check()

    w.release(list(w.live))
    w.check()
    assert w.alloc.available_size() == w.alloc.size
    assert not bool(w.alloc.refcounts().any())
