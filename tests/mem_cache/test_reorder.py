"""``reorder_rows``: beam groups on fixed rows rearranged by device index ops. A model of every
row's sequence (the K value at each column) is reordered alongside; after every step each row
must read exactly its model through its page table, its partial last page must be its own, and
the pages each row allocated (its *own*, whatever tables name them) must account for every
reference count; freeing them at the end leaves the pool empty."""

from __future__ import annotations

import pytest
import torch
from cuda_syncs import count_syncs

from edserve.mem_cache import (
    KVPool,
    PagedTokenToKVPoolAllocator,
    RefcountError,
    ReqToTokenPool,
    fork_rows,
)
from edserve.mem_cache.reorder import private_tails, reorder_rows

from ._helpers import Req, t


class Groups:
    """``G`` groups of ``B`` rows: row 0 of a group prefills ``enc + prompt`` columns; the
    others share its whole encoder pages (one reference each) and own a copy of the rest."""

    def __init__(self, ps: int, G: int, B: int, enc: int, prompt: int, steps: int,
                 device: str = "cpu", fork: bool = False, kernel: bool = False):
        width = enc + prompt + steps
        pages = G * B * (-(-width // ps) + 1)
        self.ps, self.G, self.B, self.enc, self.dev = ps, G, B, enc, torch.device(device)
        self.alloc = PagedTokenToKVPoolAllocator(pages * ps, ps, device=device)
        self.rtp = ReqToTokenPool(G * B, width + 1, device=device)
        self.kv = KVPool(pages * ps, ps, 2, 1, 1, device=device, write_kernel=kernel)
        self.reqs = [[Req() for _ in range(B)] for _ in range(G)]
        self.model: list[list[list[float]]] = []  # [G][B] K value per column
        self.own: list[list[torch.Tensor]] = []  # [G][B] slots each row holds a reference on
        self.value = 1.0
        full = enc - enc % ps
        for g in range(G):
            rows = self.rtp.alloc(self.reqs[g])
            lead = self.alloc.alloc_extend(t([0]), t([enc + prompt]), t([-1]), enc + prompt)
            self.rtp.write(rows[0], 0, lead)
            vals = self._put(lead)
            self.model.append([list(vals)])
            self.own.append([lead])
            if fork:  # the engine's way: share every page, a private partial last page
                fork_rows(self.rtp, self.alloc, [rows[0]] * (B - 1), self.reqs[g][1:],
                          [enc + prompt] * (B - 1))
                private_tails(self.rtp.req_to_token, self.alloc, rows[1:],
                              [enc + prompt] * (B - 1))
                for b in range(1, B):
                    self.model[g].append(list(vals))
                    self.own[g].append(self.rtp.req_to_token[rows[b], :enc + prompt].long())
                continue
            for b in range(1, B):
                self.alloc.share(lead[:full:ps])
                last = t([int(lead[full - 1])]) if full else t([-1])
                rest = self.alloc.alloc_extend(t([full]), t([enc + prompt]), last,
                                               enc + prompt - full)
                self.kv.copy_slots(lead[full:].to(self.kv.device), rest.to(self.kv.device))
                self.rtp.write(rows[b], 0, torch.cat([lead[:full], rest]))
                self.model[g].append(list(vals))
                self.own[g].append(torch.cat([lead[:full], rest]))
        self.length = enc + prompt

    def _put(self, slots: torch.Tensor) -> list[float]:
        vals = torch.arange(slots.numel(), dtype=torch.float32) + self.value
        self.value += slots.numel()
        v = vals[:, None, None].to(self.dev)
        self.kv.set_kv(0, slots, v, -v)
        self.kv.set_kv(1, slots, 2 * v, v)
        return vals.tolist()

    def row(self, g: int, b: int) -> int:
        return self.reqs[g][b].req_pool_idx

    def step(self, parents: list[list[int]], dec_start: int | None = None) -> None:
        """Reorder every group by ``parents[g][b]`` (slots), then one new token per row."""
        rows = [self.row(g, b) for g in range(self.G) for b in range(self.B)]
        prow = [self.row(g, parents[g][b]) for g in range(self.G) for b in range(self.B)]
        n = len(rows)
        reorder_rows(self.rtp.req_to_token, self.kv, t(rows).to(self.dev), t(prow).to(self.dev),
                     t([self.length] * n).to(self.dev),
                     t([self.enc if dec_start is None else dec_start] * n).to(self.dev))
        self.model = [[list(self.model[g][p]) for p in parents[g]] for g in range(self.G)]
        L = self.length
        for g in range(self.G):
            for b in range(self.B):
                r = self.row(g, b)
                last = t([int(self.rtp.req_to_token[r, L - 1])])
                slot = self.alloc.alloc_extend(t([L]), t([L + 1]), last, 1)
                self.rtp.write(r, L, slot)
                self.model[g][b] += self._put(slot)
                self.own[g][b] = torch.cat([self.own[g][b], slot])
        self.length += 1

    def check(self) -> None:
        L, ps = self.length, self.ps
        tails: dict[int, tuple[int, int]] = {}
        for g in range(self.G):
            for b in range(self.B):
                view = self.rtp.req_to_token[self.row(g, b), :L].long()
                for layer, scale in ((0, 1.0), (1, 2.0)):
                    got = self.kv.k_buffers[layer][view.to(self.kv.device), 0, 0].cpu()
                    assert got.tolist() == [scale * v for v in self.model[g][b]], (g, b, layer)
                if L % ps:
                    tails[int(view[L - 1]) // ps] = (g, b)
        for g in range(self.G):  # no other row's table names a row's partial last page
            for b in range(self.B):
                pages = set((self.rtp.req_to_token[self.row(g, b), :L].long() // ps).tolist())
                for p, owner in tails.items():
                    assert owner == (g, b) or p not in pages, (p, owner, (g, b))
        self.alloc.check_integrity(holders=[o for grp in self.own for o in grp])


@pytest.mark.parametrize("ps,enc", [(1, 7), (4, 8), (4, 6), (16, 37), (64, 64), (128, 92)])
def test_reordered_rows_read_their_parents_sequence(ps, enc):
    gen = torch.Generator().manual_seed(ps + enc)
    s = Groups(ps, G=3, B=3, enc=enc, prompt=3, steps=ps + 6)
    s.check()
    for _ in range(ps + 6):
        parents = torch.randint(0, 3, (3, 3), generator=gen).tolist()
        parents[0] = [0, 1, 2]  # a group whose rows all keep their own beams
        s.step(parents)
        s.check()
    for grp in s.own:  # the group ends: each row frees what it holds
        for o in grp:
            s.alloc.free_page_starts(o[::ps], shared=True)
    assert s.alloc.num_used() == 0


@pytest.mark.parametrize("ps,enc,prompt", [(1, 7, 3), (4, 6, 3), (4, 8, 5), (16, 37, 20),
                                          (128, 92, 3)])
def test_forked_rows_get_private_tails_filled_by_the_first_reorder(ps, enc, prompt):
    """Followers forked from the prefilled row share its whole pages and own a fresh partial
    page, filled (encoder tail included) by the first reorder (``dec_start = 0``)."""
    gen = torch.Generator().manual_seed(ps)
    s = Groups(ps, G=2, B=3, enc=enc, prompt=prompt, steps=ps + 2, fork=True)
    s.step([[0, 0, 0], [0, 0, 0]], dec_start=0)
    s.check()
    for _ in range(ps + 1):
        s.step(torch.randint(0, 3, (2, 3), generator=gen).tolist())
        s.check()
    for grp in s.own:
        for o in grp:
            s.alloc.free_page_starts(o[::ps], shared=True)
    assert s.alloc.num_used() == 0


def beam_parents(gen: torch.Generator, B: int) -> list[int]:
    """Parents as beam choice makes them (``beam_choices._assign_slots``): random sources, each
    source's first continuation keeps its slot, the forks take the free slots, so no moved
    row is another row's parent (the copy kernel's no-overlap rule)."""
    parents: list[int | None] = [None] * B
    forks = []
    for s in torch.randint(0, B, (B,), generator=gen).tolist():
        if parents[s] is None:
            parents[s] = s
        else:
            forks.append(s)
    free = [b for b in range(B) if parents[b] is None]
    for b, s in zip(free, forks, strict=True):
        parents[b] = s
    return parents


@pytest.mark.parametrize("ps,enc,prompt", [(1, 7, 3), (16, 37, 20), (128, 92, 3)])
def test_reorders_through_the_copy_kernel(ps, enc, prompt):
    """The engine's path on CUDA: forked rows, beam-choice parents, K/V copies through the
    Triton pair-copy kernel (its padding pairs skipped)."""
    gen = torch.Generator().manual_seed(ps + 1)
    s = Groups(ps, G=2, B=4, enc=enc, prompt=prompt, steps=ps + 2, fork=True, kernel=True)
    assert s.kv.copy_kernel
    s.step([[0] * 4, [0] * 4], dec_start=0)
    s.check()
    for _ in range(ps + 1):
        s.step([beam_parents(gen, 4) for _ in range(2)])
        s.check()
    for grp in s.own:
        for o in grp:
            s.alloc.free_page_starts(o[::ps], shared=True)
    assert s.alloc.num_used() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reorder_is_sync_free_on_cuda():
    s = Groups(16, G=2, B=3, enc=37, prompt=3, steps=4, device="cuda")
    s.kv.check_indices = False
    n = 6
    rows = torch.tensor([s.row(g, b) for g in range(2) for b in range(3)], device="cuda")
    par = rows.flip(0)
    lens = torch.full((n,), s.length, device="cuda")
    enc = torch.full((n,), 37, device="cuda")
    assert count_syncs(lambda: reorder_rows(s.rtp.req_to_token, s.kv, rows, par, lens,
                                            enc)) == 0


def test_drop_holds_keeps_pages_and_refuses_a_last_holder():
    alloc = PagedTokenToKVPoolAllocator(8 * 4, 4, debug=True)
    slots = alloc.alloc_extend(t([0]), t([8]), t([-1]), 8)  # two pages, count 1
    alloc.share(slots[::4])  # count 2
    free_before = alloc.available_size()
    alloc.drop_holds(slots[::4])
    assert alloc.refcounts()[(slots[::4] // 4).tolist()].tolist() == [1, 1]
    assert alloc.available_size() == free_before  # nothing released
    with pytest.raises(RefcountError, match="last holder"):
        alloc.drop_holds(slots[:1])
    alloc.free_page_starts(slots[::4])
    assert alloc.num_used() == 0
