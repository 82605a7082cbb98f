"""The scheduler's side of row groups: rows, pages and token history for beams and samples.

:class:`RowOps` carries out a group's decisions (:class:`~edserve.engine.row_group.GroupOps`):
forks share the source row's pages (:func:`~edserve.mem_cache.fork.fork_row`) and copy its
token history; every change to the device-side history is recorded in a
:class:`~edserve.engine.token_history.HistoryEdits` that the runner applies before the next
step. :func:`group_results` slices one step's host results per group, :func:`hold_encoder`
keeps a row's encoder region alive under its own reference (groups hold it for their lifetime,
so the word-timestamp hook can read it after every row is gone; ``keep_encoder`` hands it to
the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edserve.engine.batch_builder import Pools, release
from edserve.engine.host_copy import to_device
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, FinishReason
from edserve.engine.row_group import StepResult
from edserve.engine.sampler import row_candidates
from edserve.engine.token_history import HistoryEdits
from edserve.mem_cache import fork_rows

if TYPE_CHECKING:
    from edserve.engine.step import ScheduledBatch


class RowOps:
    """:class:`~edserve.engine.row_group.GroupOps` over the scheduler's running list.

    Decisions are recorded and carried out together by :meth:`flush` (one batch of device
    ops for all groups of a step): drops first (their rows and pages are free before any fork
    takes one), then forks."""

    def __init__(self, pools: Pools, running: list[Req], edits: HistoryEdits) -> None:
        self.pools = pools
        self.running = running
        self.edits = edits
        self._drops: list[Req] = []
        self._forks: dict[int, tuple[Req, Req, int]] = {}  # child serial -> (source, child, token)

    def advance(self, req: Req, token: int) -> None:
        if req.serial in self._forks:  # a fork of this step: its row comes with flush()
            self._forks[req.serial] = (self._forks[req.serial][0], req, token)
            return
        self.edits.last_rows.append(req.req_pool_idx)
        self.edits.last_tokens.append(token)

    def fork(self, source: Req, token: int, generator: torch.Generator | None = None) -> Req:
        child = source.fork(generator)
        self._forks[child.serial] = (source, child, token)
        return child

    def drop(self, req: Req) -> None:
        self.running.remove(req)
        req.finish_reason = FinishReason.STOP  # results still in flight for it are ignored
        self._drops.append(req)

    def flush(self) -> None:
        """Carry out the recorded drops, then the forks."""
        drops, self._drops = self._drops, []
        release(self.pools, drops)
        forks, self._forks = list(self._forks.values()), {}
        if not forks:
            return
        sources = [s.req_pool_idx for s, _, _ in forks]
        children = [c for _, c, _ in forks]
        if fork_rows(self.pools.req_to_token_pool, self.pools.allocator, sources, children,
                     [s.row_len for s, _, _ in forks]) is None:  # admission reserves rows
            raise RuntimeError("no free row for a fork (row reservation violated)")
        for (_, child, token), src in zip(forks, sources, strict=True):
            self.edits.copy_src.append(src)
            self.edits.copy_dst.append(child.req_pool_idx)
            self.advance(child, token)
        self.running.extend(children)


def group_results(sched: ScheduledBatch, tokens: list[int], logprobs: list[float],
                  cands: tuple[list[int], list[float]] | None
                  ) -> dict[int, dict[int, StepResult]]:
    """Per group (``RowGroup.id``), per member serial: this step's :class:`StepResult`."""
    per_row = row_candidates(sched.sampling.candidates, cands)
    out: dict[int, dict[int, StepResult]] = {}
    for i, req in enumerate(sched.reqs):
        if req.group is not None and req.finish_reason is None:
            out.setdefault(req.group.id, {})[req.serial] = StepResult(
                tokens[i], logprobs[i], per_row.get(i, []))
    return out


def hold_encoder(pools: Pools, req: Req, exclusive: bool = False) -> EncoderKV | None:
    """One more reference on ``req``'s encoder region (None when it has no encoder).
    ``exclusive``: the caller knows no other handle counts the region's pages
    (:attr:`EncoderKV.exclusive`)."""
    if req.enc_region == 0 or req.req_pool_idx is None:
        return None
    slots = pools.req_to_token_pool.req_to_token[req.req_pool_idx, :req.enc_region].long()
    pools.allocator.share(slots[::pools.allocator.page_size])
    return EncoderKV(slots, req.encoder_len, req.enc_region, exclusive=exclusive)


def hold_encoders(pools: Pools, reqs: list[Req]) -> list[EncoderKV | None]:
    """:func:`hold_encoder` for many requests in one gather and one count update (a prefill
    step admitting 64 beam requests took ~6 device ops per request); each handle's slots are
    a view of the one gathered table."""
    have = [r for r in reqs if r.enc_region and r.req_pool_idx is not None]
    if not have:
        return [None] * len(reqs)
    rtp, ps = pools.req_to_token_pool, pools.allocator.page_size
    width = max(r.enc_region for r in have)
    rows = to_device([r.req_pool_idx for r in have], torch.int64, rtp.req_to_token.device)
    table = rtp.req_to_token.index_select(0, rows)[:, :width].long()  # [n, width]
    held = {id(r): EncoderKV(table[i, :r.enc_region], r.encoder_len, r.enc_region)
            for i, r in enumerate(have)}
    starts = [h.slots[::ps] for h in held.values()]
    pools.allocator.share(starts[0] if len(starts) == 1 else torch.cat(starts))
    return [held.get(id(r)) for r in reqs]


def release_row_keeping_region(pools: Pools, req: Req, hold: EncoderKV) -> None:
    """Free the row of a request that computed its own encoder region and now has ``hold``
    on it: the region's pages drop the row's reference (the hold keeps them), the pages after
    the region (the row's alone) go back; no host read. A page the region ends in mid-way
    (the flat strategy's decoder starts there) belongs to the region."""
    alloc, rtp = pools.allocator, pools.req_to_token_pool
    ps = alloc.page_size
    region_pages = -(-req.enc_region // ps)
    alloc.drop_holds(hold.slots[::ps])
    if req.row_len > region_pages * ps:
        rest = rtp.req_to_token[req.req_pool_idx, region_pages * ps:req.row_len:ps].long()
        alloc.free_page_starts(rest)
    rtp.free(req)
    req.kv_len = 0


def release_encoder(pools: Pools, handle: EncoderKV, last_holder: bool = False) -> None:
    """Drop the reference :func:`hold_encoder` took. ``last_holder``: the caller knows no
    one else holds the region's pages (they all go back: no host read); otherwise finding the
    pages that reach count 0 costs a sync."""
    release_encoders(pools, [handle], last_holder)


def release_encoders(pools: Pools, handles: list[EncoderKV], last_holder: bool = False) -> None:
    """:func:`release_encoder` for many handles in one call (``last_holder`` for all)."""
    if handles:
        ps = pools.allocator.page_size
        starts = [h.slots[::ps] for h in handles]
        pools.allocator.free_page_starts(starts[0] if len(starts) == 1 else torch.cat(starts),
                                         shared=not last_holder)


def _ceil(n: int, page_size: int) -> int:
    return (n + page_size - 1) // page_size * page_size


def held_at_least(req: Req, row_len: int, ps: int) -> int:
    """Slots a row of ``row_len`` columns surely holds for its request's reservation (a row
    that reuses a held encoder region does not own that region's whole pages)."""
    shared = req.enc_region // ps * ps if req.request.encoder_kv is not None else 0
    return _ceil(row_len, ps) - shared


def groups_side_by_side(reqs: list[Req]) -> list[Req]:
    """Stable reorder putting each row group's rows next to each other (at its first row), so
    the batch's cross-attention reads a group's shared encoder K/V once (``cross_view``)."""
    first: dict[tuple[str, int], int] = {}
    keyed = []
    for i, r in enumerate(reqs):
        key = ("group", r.group.id) if r.group is not None else ("row", i)
        keyed.append((first.setdefault(key, i), i, r))
    return [r for _, _, r in sorted(keyed, key=lambda k: (k[0], k[1]))]
