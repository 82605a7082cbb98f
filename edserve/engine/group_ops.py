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

from dataclasses import replace
from typing import TYPE_CHECKING

from edserve.engine.batch_builder import Pools, release
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, FinishReason
from edserve.engine.row_group import StepResult
from edserve.engine.token_history import HistoryEdits
from edserve.mem_cache import fork_row

if TYPE_CHECKING:
    from edserve.engine.step import ScheduledBatch


class RowOps:
    """:class:`~edserve.engine.row_group.GroupOps` over the scheduler's running list."""

    def __init__(self, pools: Pools, running: list[Req], edits: HistoryEdits) -> None:
        self.pools = pools
        self.running = running
        self.edits = edits

    def advance(self, req: Req, token: int) -> None:
        self.edits.last_rows.append(req.req_pool_idx)
        self.edits.last_tokens.append(token)

    def fork(self, source: Req, token: int) -> Req:
        child = replace(source, reserved_slots=0, req_pool_idx=None, on_delta=None,
                        output_ids=[], logprobs=[], encoder_input=None, cow_pending=True)
        child.serial = Req.__dataclass_fields__["serial"].default_factory()
        if fork_row(self.pools.req_to_token_pool, self.pools.allocator, source.req_pool_idx,
                    child, source.row_len) is None:  # admission reserves rows for groups
            raise RuntimeError("no free row for a fork (row reservation violated)")
        self.edits.copy_src.append(source.req_pool_idx)
        self.edits.copy_dst.append(child.req_pool_idx)
        self.advance(child, token)
        self.running.append(child)
        return child

    def drop(self, req: Req) -> None:
        self.running.remove(req)
        release(self.pools, [req])
        req.finish_reason = FinishReason.STOP  # results still in flight for it are ignored


def group_results(sched: ScheduledBatch, tokens: list[int], logprobs: list[float],
                  cands: tuple[list[int], list[float]] | None
                  ) -> dict[int, dict[int, StepResult]]:
    """Per group (``id``), per member serial: this step's :class:`StepResult`."""
    per_row: dict[int, list[tuple[int, float]]] = {}
    plan = sched.sampling.candidates
    if plan is not None and cands is not None:
        ctoks, clps = cands
        for i, off, n in plan.layout:
            per_row[i] = list(zip(ctoks[off:off + n], clps[off:off + n], strict=True))
    out: dict[int, dict[int, StepResult]] = {}
    for i, req in enumerate(sched.reqs):
        if req.group is not None and req.finish_reason is None:
            out.setdefault(id(req.group), {})[req.serial] = StepResult(
                tokens[i], logprobs[i], per_row.get(i, []))
    return out


def hold_encoder(pools: Pools, req: Req) -> EncoderKV | None:
    """One more reference on ``req``'s encoder region (None when it has no encoder)."""
    if req.enc_region == 0 or req.req_pool_idx is None:
        return None
    slots = pools.req_to_token_pool.req_to_token[req.req_pool_idx, :req.enc_region].long()
    pools.allocator.share(slots[::pools.allocator.page_size])
    return EncoderKV(slots, req.encoder_len, req.enc_region)


def release_encoder(pools: Pools, handle: EncoderKV) -> None:
    """Drop the reference :func:`hold_encoder` took."""
    pools.allocator.free_page_starts(handle.slots[::pools.allocator.page_size], shared=True)
