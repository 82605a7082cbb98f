"""The scheduler's row-group half (a mixin of :class:`~edserve.engine.scheduler.Scheduler`):
after a step, host-chosen groups (beam search on the host, best_of) get their rows' results and
rearrange them through :class:`~edserve.engine.group_ops.RowOps`; device beam groups
(:mod:`edserve.engine.beam_rows`) report only their done flags; groups that end early (abort,
a failed step) drop every row.
"""

from __future__ import annotations

from edserve.engine.batch_builder import Pools, release
from edserve.engine.beam_rows import DeviceBeams, is_device_row
from edserve.engine.finisher import Finisher
from edserve.engine.group_ops import RowOps, group_results
from edserve.engine.req import Req
from edserve.engine.request import FinishReason
from edserve.engine.row_group import RowGroup
from edserve.engine.step import ScheduledBatch, StepOutput
from edserve.engine.token_history import HistoryEdits


class RowGroupSteps:
    pools: Pools
    running: list[Req]
    finisher: Finisher
    beams: DeviceBeams | None
    num_generated_tokens: int
    _edits: HistoryEdits

    def _length_reached(self, req: Req, tokens: int) -> bool:
        raise NotImplementedError

    def _end_group(self, group: RowGroup, reason: FinishReason,
                   error: str | None = None) -> None:
        """Stop a row group early (abort, failed step): drop every row it holds, report. A
        group that has already reported (its leader is None: a row of an overlapped batch that
        outlived its group) is left alone."""
        if group.leader is None:
            return
        rows = [r for r in self.running if r.group is group]
        for r in rows:
            self.running.remove(r)
        if group.on_device:
            self.beams.release(rows)
            self.beams.close([group], read=False)
        else:
            release(self.pools, rows)
        self._finish_group(group, reason, error)

    def _update_groups(self, sched: ScheduledBatch, output: StepOutput, tokens: list[int],
                       logprobs: list[float], no_speech: list[float | None]) -> None:
        """Hand each row group its rows' results; finish the groups that are done."""
        cands = output.fetch_candidates() if sched.sampling.candidates is not None else None
        groups = {r.group.id: r.group for r in sched.reqs
                  if r.group is not None and not is_device_row(r)}
        per_group = {gid: res for gid, res in group_results(sched, tokens, logprobs,
                                                            cands).items() if gid in groups}
        ops = RowOps(self.pools, self.running, self._edits)
        alloc = self.pools.allocator
        alloc.free_group_begin()  # the step's drops release their pages at once (one sync)
        try:
            self._decide(sched, per_group, groups, ops, no_speech)
            ops.flush()
        finally:
            alloc.free_group_end()

    def _decide(self, sched: ScheduledBatch, per_group: dict, groups: dict, ops: RowOps,
                no_speech: list[float | None]) -> None:
        for gid, results in per_group.items():
            group = groups[gid]
            if group.leader in sched.reqs and sched.is_new(sched.reqs.index(group.leader)):
                group.leader.no_speech_prob = no_speech[sched.reqs.index(group.leader)]
            self.num_generated_tokens += len(results)
            steps = max(m.steps for m in group.members)
            if group.update(results, self._length_reached(group.leader, steps), ops):
                self._finish_group(group, FinishReason.STOP)

    def _update_device_groups(self, sched: ScheduledBatch, output: StepOutput,
                              no_speech: list[float | None]) -> None:
        """Device beam groups: only their done flags come to the host; the groups done at this
        step read their finished sequences (one host read for all) and free their rows (one
        free group: one sync)."""
        done = output.fetch_beam_done()
        ended = []
        for i, req in enumerate(sched.reqs):
            group = req.group
            if not is_device_row(req) or group.slot is None or req is not group.leader:
                continue
            if sched.is_new(i):
                req.no_speech_prob = no_speech[i]
            self.num_generated_tokens += 1
            if done[group.slot]:
                ended.append(group)
        if not ended:
            return
        self.beams.close(ended)
        ids = {g.id for g in ended}
        rows = [r for r in self.running if r.group is not None and r.group.id in ids]
        self.running[:] = [r for r in self.running if r.group is None or r.group.id not in ids]
        for r in rows:
            r.finish_reason = FinishReason.STOP
        alloc = self.pools.allocator
        alloc.free_group_begin()
        try:  # every ended group's rows in one release: one upload, one free per kind
            self.beams.release(rows)
        finally:
            alloc.free_group_end()
        self.finisher.finish_groups(ended, FinishReason.STOP)

    def _finish_group(self, group: RowGroup, reason: FinishReason,
                      error: str | None = None) -> None:
        self.finisher.finish_group(group, reason, error)

