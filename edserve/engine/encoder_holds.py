"""The scheduler's held encoder regions (a mixin of :class:`~edserve.engine.scheduler.Scheduler`):
the handles given to callers (``keep_encoder``: in a finished output; ``share_encoder``: in the
first delta, :meth:`~edserve.engine.finisher.Finisher.share`), kept in the finisher's ``held``
until the caller hands them back (:meth:`EncoderHolds.release_encoder`).

The rule that keeps a region's pages safe: a request reusing a region (``encoder_kv``) runs
only while its handle is held. Once admitted its row holds the region's pages itself (a release
then only drops the handle's reference); a request queued after the release, or still waiting
when it comes, fails instead of attaching pages that may already be someone else's.
"""

from __future__ import annotations

import logging
from collections import deque

from edserve.engine.batch_builder import Pools
from edserve.engine.finisher import Finisher
from edserve.engine.group_ops import release_encoder
from edserve.engine.req import Req
from edserve.engine.request import EncoderKV, FinishReason

logger = logging.getLogger("edserve")


class EncoderHolds:
    pools: Pools
    running: list[Req]
    waiting: deque[Req]
    finisher: Finisher

    def _finish(self, req: Req, reason: FinishReason, error: str | None = None,
                last: list[int] | None = None) -> None:
        raise NotImplementedError

    @property
    def held(self) -> dict[int, EncoderKV]:
        """``keep_encoder`` / ``share_encoder`` handles given out, not released yet (by id)."""
        return self.finisher.held

    def held_regions(self) -> list[EncoderKV]:
        """Encoder regions held outside rows: caller handles and running groups' holds."""
        groups = {r.group.id: r.group for r in self.running if r.group is not None}
        return list(self.held.values()) + [g.hold for g in groups.values()
                                           if g.hold is not None]

    def _refuse_unheld(self, req: Req) -> bool:
        """Fail ``req`` (True) when it reuses a handle that is not held (released already)."""
        handle = req.request.encoder_kv
        if handle is None or handle.id in self.held:
            return False
        self._finish(req, FinishReason.ERROR, f"encoder_kv handle {handle.id} is not held "
                     "(released before the request was queued?)")
        return True

    def release_encoder(self, handle: EncoderKV) -> None:
        """Drop a handle's reference (its pages free once unused). A request still waiting
        to reuse it fails first (see the module doc)."""
        held = self.held.pop(handle.id, None)
        if held is None:
            logger.warning("release_encoder: handle %d is not held (released twice?)",
                           handle.id)
            return
        handle = held
        users = [r for r in (*self.running, *self.waiting)
                 if r.request.encoder_kv is not None and r.request.encoder_kv.id == handle.id]
        for req in [r for r in users if r.req_pool_idx is None]:  # waiting
            self.waiting.remove(req)
            self._finish(req, FinishReason.ERROR, f"encoder_kv handle {handle.id} was "
                         "released before the request ran")
        # an exclusive handle no live request reuses is its pages' last holder: no host read
        in_use = any(r.req_pool_idx is not None for r in users)
        release_encoder(self.pools, handle, last_holder=handle.exclusive and not in_use)
