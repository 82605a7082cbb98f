"""Per-worker and per-request state kept by the API process, and the least-loaded choice.

The load of a worker is its requests routed and not finished yet (waiting + running on the
worker, plus any in transit: counted by the router as it routes and as results arrive, so it
is exact and has none of the stats snapshot's lag); ties go to the worker with more free KV
slots (its latest snapshot), then to the one that received fewer requests so far.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from typing import Any

from edserve.dp.placement import Placement


@dataclass
class WorkerState:
    """One worker slot; its process is replaced on restart (``generation`` counts them)."""

    index: int
    placement: Placement
    proc: subprocess.Popen | None = None
    generation: int = 0
    down: Any = None  # zmq PUSH socket of the current incarnation
    ready: bool = False  # said hello, accepting requests
    given_up: bool = False  # failed to start too often: not restarted again
    facts: Any = None  # WorkerFacts of the current incarnation
    stats: Any = None  # its latest EngineStats
    inflight: set[str] = field(default_factory=set)
    routed: int = 0  # requests sent to this slot (all incarnations)
    finished: int = 0  # requests that finished on it (any reason)
    lost: int = 0  # requests failed because the worker died
    restarts: int = 0
    failed_starts: int = 0  # consecutive exits before a hello
    last_error: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def kv_free(self) -> int:
        return self.stats.kv_free if self.stats is not None else 0

    def describe(self) -> dict[str, Any]:
        """The worker's health entry (``/health``)."""
        return {"worker": self.index, "ready": self.ready, "pid": self.pid,
                "device": self.placement.label, "inflight": len(self.inflight),
                "routed": self.routed, "restarts": self.restarts,
                "status": "ok" if self.ready else ("failed" if self.given_up
                                                   else "starting"),
                **({"last_error": self.last_error} if self.last_error else {})}


def pick(workers: list[WorkerState]) -> WorkerState | None:
    """The least-loaded ready worker (see the module doc); None when none is ready."""
    ready = [w for w in workers if w.ready]
    if not ready:
        return None
    return min(ready, key=lambda w: (len(w.inflight), -w.kv_free, w.routed, w.index))


class Pending:
    """A request waiting for deltas: its worker and a thread-safe way to reach its queue;
    ``handles``: the caller's encoder handles its deltas carry (``keep_encoder`` output,
    ``share_encoder`` first delta) that its caller has not taken yet (see :meth:`taken`)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.handles: list[Any] = []
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def adopt(self, handle: Any) -> Any:
        """I/O thread: ``handle`` rides on a delta queued for the caller; returns it."""
        self.handles.append(handle)
        return handle

    def taken(self, delta: Any) -> None:
        """The caller got ``delta``: its handles are the caller's to release now."""
        for handle in delta.encoder_handles():
            if handle in self.handles:
                self.handles.remove(handle)

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass
