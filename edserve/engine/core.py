"""The engine-side service every engine loop runs: :class:`EngineCore`.

Both loops that own an :class:`~edserve.engine.engine.Engine` (the in-process
:class:`~edserve.engine.async_engine.AsyncEngine` thread and the data-parallel worker process,
:mod:`edserve.dp.worker`) drive it through this one object, so the rules they share live once:

- **in-flight requests**: :meth:`submit` registers a request's ``deliver``; its finished
  delta unregisters it. A delta for a request that is no longer registered (it was failed
  already) is dropped, so every request gets exactly one finished delta.
- **a failed step** (:meth:`step`): the exception is logged, every in-flight request is
  aborted and finished with ``FinishReason.ERROR``, and the engine keeps serving.
- **the stats snapshot** (:meth:`stats`), **the admission dry run** (:meth:`validate`) and
  **the integrity report** (:meth:`integrity`).

Thread contract: :meth:`submit`, :meth:`abort` and :meth:`validate` may be called from any
thread (the engine's submission queue is thread-safe); :meth:`step`, :meth:`stats`,
:meth:`integrity` and :meth:`fail_inflight` run on the loop's thread, between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.request import FinishReason, GenerateRequest
from edserve.engine.step_stats import StepTotals

logger = logging.getLogger("edserve")
Deliver = Callable[[TokenDelta], None]


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, taken on the engine thread between steps."""

    waiting: int
    running: int
    kv_used: int
    kv_free: int
    kv_total: int
    generated_tokens: int
    taken_at: float  # time.monotonic() of the snapshot
    steps: dict[str, StepTotals] = field(default_factory=dict)  # by kind (engine/step_stats)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def failed_delta(rid: str, message: str) -> TokenDelta:
    """The finished delta of a request that failed before or while it ran."""
    return TokenDelta(rid, [], finished=True,
                      output=GenerateOutput(rid, [], [], FinishReason.ERROR, error=message))


class EngineCore:
    """One engine plus its in-flight registry (see the module doc)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._inflight: dict[str, Deliver] = {}
        self._lock = threading.Lock()

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request: GenerateRequest, deliver: Deliver, stream: bool) -> None:
        """Add ``request``; ``deliver`` gets its deltas on the loop thread (only the last,
        ``finished`` with ``output``, when not ``stream``). ValueError when the engine refuses
        it (nothing is registered then)."""
        rid = request.rid

        def on_delta(delta: TokenDelta) -> None:
            if delta.finished:
                with self._lock:
                    if self._inflight.pop(rid, None) is None:
                        return  # already failed by fail_inflight
            deliver(delta)

        with self._lock:
            self._inflight[rid] = deliver
        try:
            self.engine.add_request(request, on_delta, stream)
        except BaseException:
            with self._lock:
                self._inflight.pop(rid, None)
            raise

    def abort(self, rid: str) -> None:
        """Cancel a request (any thread); its finished delta says ``ABORT``."""
        self.engine.abort(rid)

    def abort_all(self) -> None:
        for rid in self.inflight_ids():
            self.engine.abort(rid)

    def inflight_ids(self) -> list[str]:
        with self._lock:
            return list(self._inflight)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def has_work(self) -> bool:
        return self.engine.has_work()

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; False when it raised (then every in-flight request has failed
        with the step's error and the engine is ready for the next one)."""
        try:
            self.engine.step()
            return True
        except Exception as exc:
            logger.exception("engine step failed")
            self.fail_inflight(f"engine step failed: {type(exc).__name__}: {exc}")
            return False

    def fail_inflight(self, message: str) -> None:
        """Abort every in-flight request and deliver its ``ERROR`` finished delta now."""
        with self._lock:
            pending = list(self._inflight.items())
            self._inflight.clear()
        for rid, deliver in pending:
            self.engine.abort(rid)
            deliver(failed_delta(rid, message))

    # ---- calls --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The scheduler's queue lengths, the KV pool's use and the tokens generated so far
        (cheap reads; call it between steps)."""
        sched, alloc = self.engine.scheduler, self.engine.pools.allocator
        free, total = alloc.available_size(), alloc.size
        return EngineStats(waiting=len(sched.waiting), running=len(sched.running),
                           kv_used=total - free, kv_free=free, kv_total=total,
                           generated_tokens=int(sched.num_generated_tokens),
                           taken_at=time.monotonic(),
                           steps=self.engine.step_counters.snapshot())

    def validate(self, request: GenerateRequest) -> None:
        """Dry run of the engine's admission checks (any thread): ``ValueError`` when the
        request is invalid or could never fit the KV cache, even when it is empty."""
        req = self.engine.make_req(request)
        total = self.engine.pools.allocator.size
        if req.reserved_slots > total:
            raise ValueError(f"prompt + max_tokens need {req.reserved_slots} KV slots but the "
                             f"cache holds {total}; lower max_tokens")

    def integrity(self) -> dict[str, Any]:
        """The KV-cache integrity check (raises on corruption) and the stats at that moment:
        ``ok``, ``kv_slots_used``, ``kv_slots_total``, ``running``, ``waiting``,
        ``inflight``."""
        self.engine.check_integrity()
        s = self.stats()
        return {"ok": True, "kv_slots_used": s.kv_used, "kv_slots_total": s.kv_total,
                "running": s.running, "waiting": s.waiting, "inflight": self.num_inflight}
