"""One data-parallel engine worker: ``python -m edserve.dp.worker`` (started by
:mod:`edserve.dp.procs`, never by hand).

The stepping thread owns the engine: it runs one ``engine.step()`` while there is work, sends
deltas and throttled stats ``up``, runs the messages that touch the scheduler between steps,
else waits up to 100 ms for work. Messages arrive on an input thread
(:mod:`edserve.dp.worker_input`), which submits requests and aborts itself; both threads send
``up`` through one lock. It
exits when asked to stop (the ``stop`` message or SIGTERM: finish in-flight requests within the
drain timeout, then abort the rest) or when its parent dies (``PR_SET_PDEATHSIG`` plus a
parent-pid check: no orphans). SIGINT is ignored: the API process owns shutdown.
A ``keep_encoder`` / ``share_encoder`` handle stays in the scheduler's ``held``; its output (or
first delta) carries an id-only view and a request's ``encoder_kv`` (that id) is resolved there
(see :mod:`edserve.dp.handles`).
The ``features`` call (a long upload's log-mel) runs on a thread of its own
(:mod:`edserve.dp.features`) and keeps the log-mel in the worker's
:class:`~edserve.dp.mel_store.MelStore`; a request whose ``encoder_input`` is a
:class:`~edserve.audio.held_mel.MelWindowRef` gets its window written out from there.
In-flight bookkeeping, the failed-step rule, the stats snapshot, ``validate`` and
``integrity`` are the :class:`~edserve.engine.core.EngineCore`'s (shared with the in-process
``AsyncEngine``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import zmq

from edserve.audio.held_mel import MelWindowRef
from edserve.chat.grammar_filter import warm_vocab
from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.dp.features import FeatureService
from edserve.dp.handles import id_view
from edserve.dp.mel_store import MelStore, budget_from_env
from edserve.dp.worker_input import InputThread
from edserve.engine.core import EngineCore, failed_delta
from edserve.os_names import ENGINE_THREAD, name_os_thread

logger = logging.getLogger("edserve.dp")
PARENT_CHECK_S = 1.0
IDLE_STATS_S = 1.0
MAX_INTERNED_FILTERS = 4096  # distinct value-typed filters kept for sharing (then cleared)
INPUT_CALLS = frozenset({"validate", "features"})  # answered on the input thread


def _sendable(delta: Any) -> Any:
    """The delta's encoder handles (a ``share_encoder`` request's first delta, a
    ``keep_encoder`` request's output) as id-only views: their slots stay here."""
    if delta.encoder_kv is not None:
        delta.encoder_kv = id_view(delta.encoder_kv, delta.encoder_kv.id)
    out = delta.output
    if out is not None and out.encoder_kv is not None:
        out.encoder_kv = id_view(out.encoder_kv, out.encoder_kv.id)
    return delta


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux), and exit now if it already has."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)


class WorkerLoop:
    """The worker's engine loop (see the module doc); ``run()`` returns when it should exit."""

    def __init__(self, index: int, engine: Any, up: zmq.Socket, down: zmq.Socket,
                 parent_pid: int, features: FeatureService | None = None,
                 mels: MelStore | None = None) -> None:
        self.index, self.engine, self.up, self.down = index, engine, up, down
        self.features = features  # the ``features`` call's thread (None: refused)
        self.mels = mels if mels is not None else MelStore()  # log-mels held for the API
        self.core = EngineCore(engine)
        self.parent_pid = parent_pid
        self._filters: dict[Any, Any] = {}
        self.stop_deadline: float | None = None
        self.drain_timeout = 30.0
        self._last_stats: tuple = ()
        self._stats_at = 0.0
        self._send_lock = threading.Lock()  # the input thread sends rejects and replies too

        # on the stepping thread, between steps (what touches the scheduler's state)
        self._handlers = {P.ReleaseEncoder: self._on_release, P.Call: self._on_call,
                          P.Stop: self._on_stop}
        self.input = InputThread(down, {P.Generate: self._on_generate, P.Abort: self._on_abort,
                                        P.ReleaseMel: self._on_release_mel,
                                        P.Call: self._on_input_call})
        self._calls = {"integrity": lambda _: {**self.core.integrity(),
                                               "held_log_mels": len(self.mels)},
                       "validate": self.core.validate, "encoder": lambda _: self._encoder()}

    def send(self, msg: Any) -> None:
        with self._send_lock:
            wire.send(self.up, msg)

    # ---- messages ---------------------------------------------------------------------
    def _on_input_call(self, msg: P.Call) -> None:
        """Calls that need no step boundary run on the input thread; the rest are deferred."""
        if msg.name in INPUT_CALLS:
            self._on_call(msg)
        else:
            self.input.defer(msg)

    def _on_generate(self, msg: P.Generate) -> None:
        request = msg.request
        rid = request.rid
        if self.stop_deadline is not None:
            self.send(P.Delta(self.index, rid, failed_delta(rid, "worker is stopping")))
            return
        request.logits_processors = [self._intern(f) for f in request.logits_processors]
        try:
            if request.encoder_kv is not None:
                request.encoder_kv = self._held(request.encoder_kv.id)
            if isinstance(request.encoder_input, MelWindowRef):
                request.encoder_input = self.mels.window(request.encoder_input)
            self.core.submit(request, lambda d: self.send(P.Delta(self.index, rid,
                                                                  _sendable(d))), msg.stream)
        except ValueError as exc:
            self.send(P.Reject(self.index, rid, str(exc)))

    def _held(self, handle_id: int) -> Any:
        held = self.engine.scheduler.held.get(handle_id)
        if held is None:
            raise ValueError(f"encoder_kv handle {handle_id} is not held by engine worker "
                             f"{self.index} (released already?)")
        return held

    def _on_release(self, msg: P.ReleaseEncoder) -> None:
        held = self.engine.scheduler.held.get(msg.handle_id)
        if held is None:
            logger.warning("release_encoder: handle %d is not held", msg.handle_id)
        else:
            self.engine.scheduler.release_encoder(held)

    def _on_release_mel(self, msg: P.ReleaseMel) -> None:
        if not self.mels.release(msg.mel_id):
            logger.warning("release_mel: log-mel %d is not held", msg.mel_id)

    def _encoder(self) -> dict[str, int]:
        """``held``: keep_encoder handles not released; ``encoded``: encoder inputs run;
        ``mels``: log-mels held for the API process."""
        return {"held": len(self.engine.scheduler.held),
                "encoded": self.engine.runner.num_encoded_inputs, "mels": len(self.mels)}

    def _intern(self, f: Any) -> Any:
        """One instance per distinct value-typed filter, so the sampler's per-filter caches
        are shared. Identity-equal filters (one per request, e.g. a grammar) pass through:
        kept here they would never be found again, only held forever."""
        if f.per_row or type(f).__hash__ is object.__hash__:
            return f
        if len(self._filters) >= MAX_INTERNED_FILTERS:  # distinct settings keep coming
            self._filters.clear()
        try:
            return self._filters.setdefault(f, f)
        except TypeError:  # unhashable
            return f

    def _on_abort(self, msg: P.Abort) -> None:
        self.core.abort(msg.rid)

    def _on_call(self, msg: P.Call) -> None:
        if msg.name == "features" and self.features is not None:
            self.features.submit(msg.call_id, msg.arg)  # answered by its own thread
            return
        try:
            fn = self._calls.get(msg.name)
            if fn is None:
                raise ValueError(f"unknown engine call {msg.name!r}")
            value = fn(msg.arg)
        except Exception as exc:
            self.send(P.Reply(self.index, msg.call_id, False, str(exc), type(exc).__name__))
        else:
            self.send(P.Reply(self.index, msg.call_id, True, value))

    def _on_stop(self, msg: P.Stop) -> None:
        self.drain_timeout = msg.drain_timeout
        self.request_stop()

    def request_stop(self) -> None:
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.drain_timeout

    # ---- loop -------------------------------------------------------------------------
    def _send_stats(self, now: float) -> None:
        s = self.core.stats()
        key = (s.waiting, s.running, s.kv_free, s.generated_tokens)
        due = now - self._stats_at >= (P.STATS_INTERVAL_S if key != self._last_stats
                                       else IDLE_STATS_S)
        if due:
            self.send(P.Stats(self.index, s))
            self._last_stats, self._stats_at = key, now

    def run(self) -> None:
        self.input.start()
        try:
            self._run()
        finally:
            self.input.stop()

    def _run(self) -> None:
        parent_checked = time.monotonic()
        wake = self.input.wake
        while True:
            if not self.engine.has_work():
                asleep = time.perf_counter()
                wake.wait(0.1)
                self.engine.step_counters.idle_seconds += time.perf_counter() - asleep
            wake.clear()  # before the checks below: a later message sets it again
            self.input.drain(lambda msg: P.dispatch(self._handlers, msg))
            if self.engine.has_work():
                self.core.step()  # a failed step fails what was in flight; we keep serving
            now = time.monotonic()
            self._send_stats(now)
            if self.stop_deadline is not None:
                if not self.core.num_inflight and not self.engine.has_work():
                    return
                if now > self.stop_deadline:
                    self.core.abort_all()
                    while self.engine.has_work():  # the aborts finish (and free) the rows
                        self.core.step()
                    return
            if now - parent_checked > PARENT_CHECK_S:
                parent_checked = now
                if os.getppid() != self.parent_pid:
                    return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="edserve.dp.worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--up", required=True)
    p.add_argument("--down", required=True)
    p.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(levelname)s worker{args.index}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    up, down = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    up.setsockopt(zmq.LINGER, 5000)
    down.setsockopt(zmq.LINGER, 0)
    up.connect(args.up)
    down.connect(args.down)
    try:
        import torch

        from edserve.config import EngineConfig
        from edserve.runtime import build_engine

        mels = MelStore(budget_from_env())  # ValueError for a bad EDSERVE_HELD_MEL_BYTES
        engine = build_engine(EngineConfig(**json.loads(args.config)))
        threads = torch.get_num_threads() if engine.device.type == "cpu" else None
        facts = P.WorkerFacts(os.getpid(), engine.tokenizer, engine.model.config,
                              engine.max_decoder_len, engine.is_mllama, str(engine.device),
                              threads, engine.config.max_running_requests)
    except Exception as exc:
        wire.send(up, P.Failed(args.index, f"{type(exc).__name__}: {exc}"))
        up.close()
        ctx.term()
        return 1
    warm_vocab(engine)  # chat: the JSON-mode vocabulary, off this (the stepping) thread
    n_mels = getattr(engine.model.config, "num_mel_bins", None)
    features = FeatureService(args.index, ctx, args.up, engine.device, n_mels, store=mels)
    loop = WorkerLoop(args.index, engine, up, down, args.parent_pid, features, mels)
    signal.signal(signal.SIGTERM, lambda *_: loop.request_stop())
    loop.send(P.Hello(args.index, facts))
    name_os_thread(ENGINE_THREAD)  # this thread steps the engine: name it as the in-process one
    try:
        loop.run()
    finally:
        loop.send(P.Bye(args.index))
        features.close()
        down.close()
        up.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
