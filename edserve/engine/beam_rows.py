"""Beam search on fixed rows with the choice on the device: the host learns only which groups
are done, so beam steps overlap like greedy ones (``EngineConfig.beam_on_device``).

A :class:`DeviceBeamGroup` holds ``beam_size`` rows for its whole life: at admission the
leader prefills and the followers fork it (every page shared, a private partial last page:
:func:`~edserve.mem_cache.reorder.private_tails`); every step runs every row. After sampling,
:meth:`DeviceBeams.run` (device ops only) ranks the groups' top-(beam + 1) candidates
(:class:`~edserve.engine.beam_device.BeamBatch`, slot ``b`` = row ``b`` of the group), makes
each row take its new beam's sequence (page tables and the partial page's K/V:
:func:`~edserve.mem_cache.reorder.reorder_rows`; token history) and leaves a ``[capacity]``
done flag in the step's host copy. Dead slots mirror the best beam (their results are ignored).

Pages: a row *owns* the pages it allocated or forked (``own``: its page table without the
reorders; reference counts count owners), while its page table may name any whole page of its
group; the group's rows free their own pages when it ends, without a host read
(:meth:`DeviceBeams.release`). Admission's reservation covers this: each row allocates at most
what a one-row request of the group's length would. A step in which groups end reads their
finished sequences once (one host read for all of them); other steps read nothing but the
step's results copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.batch_builder import Pools
from edserve.engine.beam_device import BeamBatch
from edserve.engine.beam_graph import make_beam_stepper
from edserve.engine.beam_run_graph import BeamRunGraphs
from edserve.engine.beam_search import BeamGroup
from edserve.engine.host_copy import to_device
from edserve.engine.req import Req
from edserve.engine.row_group import Finished
from edserve.engine.token_history import TokenHistory
from edserve.mem_cache import fork_rows, private_tails, reorder_rows


class DeviceBeamGroup(BeamGroup):
    """A beam group whose rows are fixed and whose choice is made by :class:`DeviceBeams`
    (``members``: its rows, slot order; ``update`` is never called)."""

    on_device = True

    def __init__(self, leader, beam_size: int, stop_ids: frozenset[int],
                 length_penalty: float | None, patience: float | None) -> None:
        super().__init__(leader, beam_size, stop_ids, length_penalty, patience)
        self.patience = patience
        self.slot: int | None = None  # its group slot in DeviceBeams.state (None once over)
        self.member_pos: dict[int, int] | None = None  # id(row) -> its slot in members
        self.chosen: Finished | None = None  # its best finished sequence, once read

    def update(self, results, at_limit, ops) -> bool:
        raise RuntimeError("a device beam group is updated on the device (DeviceBeams.run)")

    def result(self) -> Finished:
        if self.chosen is None:
            raise RuntimeError(f"beam group {self.id} has no finished sequence")
        return self.chosen


def is_device_row(req: Req) -> bool:
    return req.group is not None and req.group.on_device


@dataclass
class BeamStepPlan:
    """One step's device-beam work (index tensors on the device, built by the scheduler).

    Every index tensor is a view of ``packed``, one upload laid out as ``[2R | 5P | G*B | G]``
    (see :meth:`DeviceBeams.views`), so a graph replay of :meth:`DeviceBeams.run` takes the whole
    plan in one device copy."""

    beams: DeviceBeams
    packed: torch.Tensor  # [2R + 5P + G*B + G] int64
    R: int  # rows among the sampler's top-k candidates
    P: int  # rows of the batch's groups
    cand_g: torch.Tensor  # [R] group slot of each top-k row of the sampler's candidates
    cand_b: torch.Tensor  # [R] its slot in the group
    at_limit: torch.Tensor  # [capacity] bool: the group's length limit is reached
    rows: torch.Tensor  # [P] int64 every row of the batch's groups (followers not in it too)
    g: torch.Tensor  # [P] group slot
    b: torch.Tensor  # [P] slot in the group
    row_of: torch.Tensor  # [capacity, B] int64 row of each (group, slot) of these groups
    lengths: torch.Tensor  # [P] filled columns after this step's write
    dec_start: torch.Tensor  # [P] first decoder column (0: the prefill step: copy everything)


class DeviceBeams:
    """The scheduler's side: group slots, own pages, admission and release of rows."""

    def __init__(self, pools: Pools, capacity: int, max_beam: int, max_tokens: int,
                 stepper: str | None = None, choice: str | None = None) -> None:
        self.pools = pools
        self.state = BeamBatch(capacity, max_beam, max_tokens, pools.device, choice)
        # the choice's launches: a CUDA graph on CUDA (beam_graph.make_beam_stepper)
        self.stepper = make_beam_stepper(self.state, max_beam + 1, stepper)
        # run()'s whole work as CUDA graphs where the choice is one (beam_run_graph)
        self.graphs = BeamRunGraphs() if self.stepper.name == "graph" else None
        self.own = torch.zeros_like(pools.req_to_token_pool.req_to_token)  # [rows + 1, C]
        self._free = list(range(capacity - 1, -1, -1))

    # ---- rows -------------------------------------------------------------------------
    def admit(self, groups: list[DeviceBeamGroup]) -> list[Req]:
        """After the leaders' prefill batch is built: a group slot each, and the followers'
        rows (forked from their leader; returned in group order, to run from the next step
        on). All groups of the step together: one fork, one private-tail pass, one upload of
        the own table and one state admission, whatever the number of groups (group by group,
        a beam run's prefill phase took ~61 ms longer than greedy's at 64 groups on the H200:
        benchmarks/RESULTS.md, wave 27)."""
        if not groups:
            return []
        for g in groups:
            g.slot = self._free.pop()
        self.state.admit_many([g.slot for g in groups], [g.size for g in groups],
                              [g.patience for g in groups], [g.stop_ids for g in groups])
        followers = [[g.leader.fork(None) for _ in range(g.size - 1)] for g in groups]
        flat = [f for fs in followers for f in fs]
        parents = [g.leader.req_pool_idx for g, fs in zip(groups, followers, strict=True)
                   for _ in fs]
        lengths = [g.leader.row_len for g, fs in zip(groups, followers, strict=True) for _ in fs]
        rtp = self.pools.req_to_token_pool
        if fork_rows(rtp, self.pools.allocator, parents, flat, lengths) is None:
            raise RuntimeError("no free row for a beam group (row reservation violated)")
        private_tails(rtp.req_to_token, self.pools.allocator, [f.req_pool_idx for f in flat],
                      lengths)
        for f in flat:
            f.cow_pending = False
        rows = to_device([g.leader.req_pool_idx for g in groups] + [f.req_pool_idx for f in flat],
                         torch.int64, self.pools.device)
        self.own[rows] = rtp.req_to_token.index_select(0, rows)
        for g, fs in zip(groups, followers, strict=True):
            g.members = [g.leader] + fs
            g.member_pos = None
            g.hyps = {}
        return flat

    def record(self, reqs: list[Req]) -> None:
        """Own-table entries of the column each of ``reqs``' device rows just took."""
        picked = [(r.req_pool_idx, r.row_len - 1) for r in reqs if is_device_row(r)]
        if not picked:
            return
        idx = to_device([x for p in picked for x in p], torch.int64, self.pools.device)
        rows, cols = idx[0::2], idx[1::2]
        self.own[rows, cols] = self.pools.req_to_token_pool.req_to_token[rows, cols]

    def release(self, rows: list[Req]) -> None:
        """Free whole device groups' rows (every row of each group at once) without a host
        read: which pages reach count 0 is known from columns. With ``ps`` the page size,
        ``H`` the leader's leading pages held elsewhere (the group's encoder hold: the
        encoder region's pages; a reused region: its whole pages) and ``Pf`` the prefill's
        whole pages (the followers forked them), a follower drops its hold on pages
        ``< Pf`` and frees the rest (its own), the leader drops pages ``< H`` and frees the
        rest after the followers' drops, so each freed page goes from count 1 to 0."""
        rtp, alloc = self.pools.req_to_token_pool, self.pools.allocator
        ps = alloc.page_size
        drop: list[tuple[int, int, int]] = []  # (row, first page, end page) to drop / free
        free: list[tuple[int, int, int]] = []
        holding = [r for r in rows if r.req_pool_idx is not None]
        for r in holding:
            g, n = r.group, -(-r.row_len // ps)
            enc = r.enc_region
            held = -(-enc // ps) if g.hold is not None else enc // ps  # H
            pf = min((enc + len(r.prompt_ids)) // ps, n)
            cut = min(held, n) if r is g.leader else pf
            drop.append((r.req_pool_idx, 0, cut))
            free.append((r.req_pool_idx, cut, n))
        for spans, fn in ((drop, alloc.drop_holds),
                          (free, lambda s: alloc.free_page_starts(s, shared=False))):
            flat = [c * ps for _, a, b in spans for c in range(a, b)]
            which = [i for i, (_, a, b) in enumerate(spans) for _ in range(a, b)]
            if not flat:
                continue
            idx = to_device([spans[i][0] for i in which] + flat, torch.int64,
                            self.pools.device)
            k = len(flat)
            fn(self.own[idx[:k], idx[k:]].long())
        for r in holding:
            rtp.free(r)
            r.kv_len = 0

    def close(self, groups: list[DeviceBeamGroup], read: bool = True) -> None:
        """The groups are over: read their best finished sequences (``read``: one host read
        for all) and free their slots."""
        groups = [g for g in groups if g.slot is not None]
        if read and groups:
            # a finished sequence has at most one token per step its rows were scheduled for
            upto = max(m.steps for g in groups for m in g.members)
            chosen = self.state.best([g.slot for g in groups],
                                     [g.length_penalty for g in groups], upto)
            for g, fin in zip(groups, chosen, strict=True):
                g.chosen = fin
        self.state.release([g.slot for g in groups])
        for g in groups:
            self._free.append(g.slot)
            g.slot = None

    def holder(self, req: Req) -> torch.Tensor:
        """The slots ``req``'s row holds a reference on (for the integrity check)."""
        return self.own[req.req_pool_idx, :req.row_len].long()

    # ---- steps ------------------------------------------------------------------------
    def plan(self, reqs: list[Req], new: list[bool], at_limit: dict[int, bool]
             ) -> BeamStepPlan | None:
        """The step's plan for the device groups among ``reqs`` (batch order; ``new``: the
        row prefills in this step); ``at_limit`` per group slot."""
        groups: dict[int, DeviceBeamGroup] = {}
        cand: list[int] = []
        fresh: set[int] = set()
        for r, n in zip(reqs, new, strict=True):
            g = r.group
            if g is not None and g.on_device and g.slot is not None:
                groups.setdefault(g.slot, g)
                pos = g.member_pos
                if pos is None:  # members are fixed from admit() on
                    pos = g.member_pos = {id(m): b for b, m in enumerate(g.members)}
                cand += (g.slot, pos[id(r)])
                if n:
                    fresh.add(g.slot)
        if not groups:
            return None
        per_row: list[int] = []
        row_of = [0] * (self.state.G * self.state.B)
        B = self.state.B
        for s, g in groups.items():
            enc = s in fresh
            for b, m in enumerate(g.members):
                per_row += (m.req_pool_idx, s, b, m.row_len, 0 if enc else m.enc_region)
                row_of[s * B + b] = m.req_pool_idx
        limit = [at_limit.get(s, False) for s in range(self.state.G)]
        packed = to_device(cand + per_row + row_of + limit, torch.int64, self.pools.device)
        return self.views(packed, len(cand) // 2, len(per_row) // 5)

    def views(self, packed: torch.Tensor, R: int, P: int) -> BeamStepPlan:
        """The plan whose index tensors are views of ``packed`` (``[2R | 5P | G*B | G]``:
        this step's upload, or a graph's static copy of it)."""
        G, B = self.state.G, self.state.B
        c = packed[:2 * R].view(R, 2).t()
        p = packed[2 * R:2 * R + 5 * P].view(P, 5).t()
        o = 2 * R + 5 * P
        return BeamStepPlan(self, packed, R, P, c[0], c[1], packed[o + G * B:].bool(), p[0],
                            p[1], p[2], packed[o:o + G * B].view(G, B), p[3], p[4])

    def run(self, plan: BeamStepPlan, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
            k: int, history: TokenHistory) -> torch.Tensor:
        """After sampling (device ops only): choose the beams, move the rows; returns the
        ``[capacity]`` done flags. ``cand_*``: the sampler's flat top-k candidates, the
        device rows' first (``k`` per row, in batch order). On CUDA a shape seen before runs
        as one graph replay (:class:`~edserve.engine.beam_run_graph.BeamRunGraphs`)."""
        kk = min(k, self.state.B + 1)
        toks = cand_tokens[:plan.R * k].view(plan.R, k)[:, :kk]  # [R, kk]
        lps = cand_logprobs[:plan.R * k].view(plan.R, k)[:, :kk]
        if self.graphs is not None:
            return self.graphs.run(self, plan, toks, lps, history)
        return self.apply(plan, toks, lps, history)

    @staticmethod
    def copy_start(plan: BeamStepPlan, parent_rows: torch.Tensor,
                   history: TokenHistory) -> torch.Tensor:
        """[P] the first column whose K/V a row that takes ``parent_rows``' sequence must copy:
        past the tokens the two sequences share. Column ``c`` holds the K/V of the sequence's
        ``c``-th token, written once by the row that first held that prefix and copied
        unchanged to every row that took it since (forks share the prompt, reorders copy), so
        two rows of a group hold bit-identical K/V wherever their tokens agree. The history's
        last token (this step's pick, not yet written) is not counted. A group's first step
        (``dec_start`` 0: the followers' private pages still empty) copies everything."""
        n = history.lengths.index_select(0, plan.rows) - 1  # [P] sampled tokens with K/V
        shared = history.common_prefix(plan.rows, parent_rows, n)
        first_diff = plan.lengths - n + shared  # column of the first token that differs
        return torch.where(plan.dec_start > 0, torch.maximum(plan.dec_start, first_diff),
                           plan.dec_start)

    def apply(self, plan: BeamStepPlan, toks: torch.Tensor, lps: torch.Tensor,
              history: TokenHistory, captured: bool = False) -> torch.Tensor:
        """:meth:`run`'s work, eagerly (``captured``: inside a graph capture, so the choice
        runs as plain ops rather than its own graph's replay)."""
        kk = toks.shape[1]
        ct, cl, at_limit = self.stepper.inputs()  # [G, B, T], [G, B, T], [G]
        ct[plan.cand_g, plan.cand_b, :kk] = toks
        cl[plan.cand_g, plan.cand_b, :kk] = lps.float()
        at_limit.copy_(plan.at_limit)
        choice = self.state.step(ct, cl, at_limit) if captured else self.stepper.step()
        par = choice.parents[plan.g, plan.b]  # [P] slot, -1: dead or done
        first = choice.lead[plan.g]  # dead rows mirror the best beam
        par = torch.where(par >= 0, par, torch.where(first >= 0, first, plan.b))
        parent_rows = plan.row_of[plan.g, par]
        kv = self.pools.kv_pool
        reorder_rows(self.pools.req_to_token_pool.req_to_token, kv, plan.rows, parent_rows,
                     plan.lengths, self.copy_start(plan, parent_rows, history))
        going = first >= 0  # [P] the group goes on
        last = torch.where(going, choice.tokens[plan.g, plan.b], history.last(plan.rows))
        history.reorder(plan.rows, torch.where(going, parent_rows, plan.rows), last)
        return choice.done
