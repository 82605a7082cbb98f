"""How requests end: the KV hook, the encoder hold, freeing the row, the final delta.

A request that finished normally (stop or length) may read its KV once more before its pages go
(``on_finished_kv``: word timestamps); a request that asked for ``keep_encoder`` leaves its
encoder region held under a handle (``held``) until the caller releases it (so does a request
whose prompt check rejected its guess: :mod:`edserve.engine.prompt_check`); a
``share_encoder`` request's handle is taken after its prefill and rides on its first delta
(:meth:`Finisher.share`). A row group reports its chosen sequence through its leader; its
encoder hold (taken at prefill) serves the hook after its rows are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edserve.engine.batch_builder import Pools, release
from edserve.engine.group_ops import (
    hold_encoder,
    release_encoder,
    release_encoders,
    release_row_keeping_region,
)
from edserve.engine.outputs import TokenDelta
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, FinishedKV, FinishReason
from edserve.engine.row_group import RowGroup

logger = logging.getLogger("edserve")


class Finisher:
    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.held: dict[int, EncoderKV] = {}  # keep_encoder handles not yet released

    def share(self, req: Req) -> None:
        """A ``share_encoder`` request's prefill has written its encoder region: take a hold
        for the caller (``held``; the next delta carries it, :meth:`Req.take_share`). From now
        on the row's pages are shared (``Req.shares_pages``): its free drops references, and
        the region lives on while the handle holds it. No region (text-only): no handle."""
        hold = hold_encoder(self.pools, req)
        if hold is not None:
            req.shared_encoder = True
            self.held[hold.id] = req.share_out = hold

    def finish_groups(self, groups: list[RowGroup], reason: FinishReason) -> None:
        """:meth:`finish_group` for several device beam groups ending in one step, their
        encoder holds released together (one allocator call: they are the regions' last
        holders, so nothing is read)."""
        last: list[EncoderKV] = []
        for group in groups:
            self.finish_group(group, reason, release_to=last)
        release_encoders(self.pools, last, last_holder=True)

    def finish_group(self, group: RowGroup, reason: FinishReason,
                     error: str | None = None, release_to: list | None = None) -> None:
        """Report a group's result through its leader (its rows are already dropped). The
        group's encoder hold serves the KV hook, then goes to the caller or is released
        (``release_to``: appended there for the caller to release, a device group's only)."""
        leader, hold = group.leader, group.hold
        group.hold = None
        if reason == FinishReason.STOP:
            best = group.result()
            leader.output_ids, leader.logprobs = list(best.tokens), list(best.logprobs)
            leader.stop_logprob = best.stop_logprob
            reason = FinishReason.STOP if best.stop_logprob is not None else FinishReason.LENGTH
            region = hold or leader.request.encoder_kv
            if region is not None:
                reason, error = self._run_hook(leader, reason, error, lambda: FinishedKV(
                    region.slots, region.encoder_len, region.enc_region, self.pools.kv_pool,
                    list(leader.prompt_ids), list(leader.output_ids)))
        # a device beam group's rows have dropped their holds (DeviceBeams.release): its
        # hold is the region's last holder, so releasing it reads nothing from the device
        self._keep_or_release(leader, hold, reason, last_holder=group.on_device,
                              release_to=release_to if group.on_device else None)
        self._report(leader, reason, error, [])
        # unlink group -> leader: leader <-> group was a cycle that held the request (its hooks
        # and what they hold: the model, for a readout) until the cycle collector ran
        group.leader = None

    def finish(self, req: Req, reason: FinishReason, error: str | None,
               last: list[int]) -> None:
        """End a single-row request: KV hook, encoder hold, free its row, final delta."""
        self.finish_many([(req, reason, error, last)])

    def finish_many(self, ending: list[tuple[Req, FinishReason, str | None, list[int]]]
                    ) -> None:
        """:meth:`finish` for the single-row requests ending in one step: every KV hook, then
        the rows freed in one grouped release (a request at a time cost ~12 small device ops,
        ~770 for 64 requests ending together), then every final delta, in order."""
        done, free = [], []
        for req, reason, error, last in ending:
            kept = None
            if req.req_pool_idx is not None:
                if not req.check_rejected:  # a wrong guess has no output to read the KV for
                    reason, error = self._run_hook(req, reason, error,
                                                   lambda r=req: self._finished_kv(r))
                keep = req.request.keep_encoder or req.check_rejected  # the retry reuses it
                if keep and req.request.encoder_kv is None and req.group is None \
                        and reason in (FinishReason.STOP, FinishReason.LENGTH):
                    # the row computed its region: the handle is its only other holder
                    kept = hold_encoder(self.pools, req, exclusive=True)
            if kept is not None:
                self.held[kept.id] = req.kept_encoder = kept
                release_row_keeping_region(self.pools, req, kept)
            else:
                free.append(req)
            done.append((req, reason, error, last))
        release(self.pools, free)
        for req, reason, error, last in done:
            self._report(req, reason, error, last)

    def _run_hook(self, req: Req, reason: FinishReason, error: str | None,
                  kv: Callable[[], FinishedKV]) -> tuple[FinishReason, str | None]:
        """Call ``on_finished_kv`` for a normal finish; a failing hook fails the request."""
        hook = req.request.on_finished_kv
        if hook is None or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return reason, error
        try:
            hook(kv())
        except Exception as exc:  # the request fails, the engine goes on
            logger.exception("on_finished_kv failed")
            return FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
        return reason, error

    def _keep_or_release(self, req: Req, hold: EncoderKV | None, reason: FinishReason,
                         last_holder: bool = False, release_to: list | None = None) -> None:
        """A finished request's encoder hold: the caller's (``keep_encoder``) or released
        (``last_holder``: see :func:`release_encoder`; ``release_to``: left to the caller)."""
        if hold is None:
            return
        if req.request.keep_encoder and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.held[hold.id] = req.kept_encoder = hold
        elif release_to is not None:
            release_to.append(hold)
        else:
            release_encoder(self.pools, hold, last_holder)

    def _report(self, req: Req, reason: FinishReason, error: str | None,
                last: list[int]) -> None:
        req.finish_reason = reason
        req.error = error
        req.encoder_input = None
        on_delta, req.on_delta = req.on_delta, None  # the last call: the caller's callback
        # (and what it holds, e.g. the engine) must not live on in a group's row cycle
        if on_delta is not None:
            known = last and req.output_ids[-len(last):] == last  # their logprobs are kept
            tops = req.top_logprobs[-len(last):] if known and req.top_logprobs else []
            on_delta(TokenDelta(req.rid, last, finished=True, output=req.output(),
                                logprobs=req.logprobs[-len(last):] if known else [],
                                top_logprobs=tops, encoder_kv=req.take_share()))
        elif req.share_out is not None:  # nobody to hand it to
            self.held.pop(req.share_out.id, None)
            release_encoder(self.pools, req.take_share())

    def _finished_kv(self, req: Req) -> FinishedKV:
        rtp = self.pools.req_to_token_pool
        return FinishedKV(rtp.req_to_token[req.req_pool_idx, :req.row_len].long(),
                          req.encoder_len, req.enc_region, self.pools.kv_pool,
                          list(req.prompt_ids), list(req.output_ids))
