"""The API process's side of the workers: sockets, one I/O thread, restarts, shutdown.

The I/O thread owns the ``up`` socket: it dispatches every worker message (deltas into the
waiting coroutine's queue through ``call_soon_threadsafe``, replies into futures, stats and
hellos into :class:`~edserve.dp.router.WorkerState`) and polls the worker processes every
50 ms. A worker that exits fails its in-flight requests and calls with
:class:`~edserve.dp.errors.WorkerLost` and is started again on a fresh ``down`` endpoint
(after ``MAX_FAILED_STARTS`` exits in a row before its hello, it is given up). Request
submission, aborts and calls send on the ``down`` sockets from any thread under one lock.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq

from edserve.dp import procs, wire
from edserve.dp import protocol as P
from edserve.dp.errors import WorkerLost
from edserve.dp.handles import EncoderHandles
from edserve.dp.held_mels import HeldMels
from edserve.dp.placement import Placement
from edserve.dp.router import Pending, WorkerState, pick

logger = logging.getLogger("edserve.dp")
MAX_FAILED_STARTS = 3


class Supervisor:
    """Starts ``placements`` as workers and keeps them running (see the module doc)."""

    def __init__(self, placements: list[Placement], log_level: str = "WARNING") -> None:
        self.workers = [WorkerState(i, p) for i, p in enumerate(placements)]
        self.log_level = log_level
        self.lock = threading.RLock()
        self.pending: dict[str, Pending] = {}
        self.calls: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self.handles = EncoderHandles()  # keep_encoder handles given out (dp/handles.py)
        # log-mels kept by workers (held_mels.py)
        self.mels = HeldMels(lambda w, gen, mel_id: self.send_to(w, gen, P.ReleaseMel(mel_id)))
        self._call_ids = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="edserve-dp-")
        self._ctx = zmq.Context()
        self._up = self._ctx.socket(zmq.PULL)
        self._up.setsockopt(zmq.LINGER, 0)
        self.up_endpoint = f"ipc://{self._dir}/up"
        self._up.bind(self.up_endpoint)
        self.closing = False  # no new requests; workers are not restarted
        self._stop_io = threading.Event()
        self._started = False
        self._thread = threading.Thread(target=self._io_loop, name="edserve-dp-io",
                                        daemon=True)
        self._handlers = {P.Hello: self._on_hello, P.Failed: self._on_failed,
                          P.Delta: self._on_delta, P.Reject: self._on_reject,
                          P.Stats: self._on_stats, P.Reply: self._on_reply, P.Bye: self._on_bye}

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        """Start every worker (from the I/O thread, so ``PR_SET_PDEATHSIG`` follows it) and
        wait until all said hello; RuntimeError (after cleaning up) when one cannot start."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            failed = [w for w in self.workers if w.given_up]
            if failed or time.monotonic() > deadline:
                why = "; ".join(f"worker {w.index}: {w.last_error or 'did not start'}"
                                for w in failed or self.workers if not w.ready)
                self.shutdown(0.0)
                raise RuntimeError(f"data-parallel workers failed to start: {why}")
            time.sleep(0.05)
        self._started = True

    def _spawn(self, w: WorkerState) -> None:
        w.generation += 1
        endpoint = f"ipc://{self._dir}/down-{w.index}-{w.generation}"
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        with self.lock:
            w.down, w.ready, w.facts, w.stats = sock, False, None, None
        w.proc = procs.spawn(w.index, w.placement, self.up_endpoint, endpoint, self.log_level)
        logger.info("worker %d started (pid %d, %s)", w.index, w.proc.pid, w.placement.label)

    def shutdown(self, drain_timeout: float) -> None:
        """Stop routing, let in-flight requests finish (at most ``drain_timeout`` s), stop the
        workers (SIGKILL whatever is still alive after the grace period), fail what is left
        with a 503, close the sockets. Idempotent."""
        if self._stop_io.is_set():
            return
        self.closing = True
        deadline = time.monotonic() + drain_timeout
        while self.pending and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        with self.lock:
            for w in self.workers:
                self.send(w, P.Stop(0.0))
        for w in self.workers:
            if w.proc is not None:
                procs.stop(w.proc, max(1.0, deadline - time.monotonic()) + 5.0)
        self._stop_io.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self.lock:
            for w in self.workers:
                self._fail_worker(w, WorkerLost("the server is shutting down", "shutting_down"))
                if w.down is not None:
                    w.down.close()
                    w.down = None
        self._up.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- sending ------------------------------------------------------------------------
    def send(self, w: WorkerState, msg: Any) -> bool:
        """Send (caller holds the lock); False when the worker cannot take it now."""
        if w.down is None:
            return False
        try:
            wire.send(w.down, msg, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def send_to(self, worker: int, generation: int, msg: Any) -> bool:
        """Send ``msg`` to slot ``worker`` if it still runs incarnation ``generation`` (what the
        message refers to lives there: a held encoder region or log-mel); False when that
        incarnation is gone (and what it held with it) or cannot take messages now."""
        with self.lock:
            w = self.workers[worker]
            return w.ready and w.generation == generation and self.send(w, msg)

    def submit(self, rid: str, frames: list, worker: int | None = None) -> Pending:
        """Route one encoded :class:`~edserve.dp.protocol.Generate` (its
        :func:`~edserve.dp.wire.encode` frames) to ``worker`` (the one
        holding its encoder handle) or else the least-loaded worker."""
        with self.lock:
            w = None if self.closing else pick(self.workers if worker is None
                                               else [self.workers[worker]])
            if w is None:
                raise WorkerLost("the server is shutting down" if self.closing else
                                 "no engine worker is available (restarting)", "no_worker")
            p = Pending(w.index)
            try:
                w.down.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its queue is full: it died (or hangs) with work queued
                w.lost += 1
                raise WorkerLost(f"engine worker {w.index} is not accepting requests") from None
            self.pending[rid] = p
            w.inflight.add(rid)
            w.routed += 1
            return p

    def forget(self, rid: str, abort: bool) -> None:
        """The caller stopped listening: drop the request, and abort it on its worker."""
        with self.lock:
            p = self.pending.pop(rid, None)
            if p is None:
                return
            w = self.workers[p.worker]
            w.inflight.discard(rid)
            if abort:
                self.send(w, P.Abort(rid))

    def call(self, w: WorkerState, name: str, arg: Any = None) -> concurrent.futures.Future:
        """Run ``name`` (``integrity``, ``validate``) on worker ``w`` between its steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            call_id = next(self._call_ids)
            self.calls[call_id] = (w.index, fut)
            if not (w.ready and self.send(w, P.Call(call_id, name, arg))):
                self.calls.pop(call_id)
                fut.set_exception(WorkerLost(f"engine worker {w.index} is not ready"))
        return fut

    # ---- the I/O thread -----------------------------------------------------------------
    def _io_loop(self) -> None:
        for w in self.workers:
            self._spawn(w)
        while not self._stop_io.is_set():
            try:
                if self._up.poll(50):
                    while True:
                        try:
                            msg = wire.recv(self._up, zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(msg)
                self._check_procs()
            except Exception:  # never let the I/O thread die: everything would hang
                logger.exception("data-parallel I/O loop error")

    def _dispatch(self, msg: Any) -> None:
        with self.lock:
            P.dispatch(self._handlers, msg)

    def _on_hello(self, msg: P.Hello) -> None:
        w = self.workers[msg.worker]
        if w.proc is None or msg.facts.pid != w.proc.pid:
            return  # a predecessor's late hello
        w.facts, w.ready, w.failed_starts, w.last_error = msg.facts, True, 0, None
        logger.info("worker %d ready (pid %d)", w.index, msg.facts.pid)

    def _on_failed(self, msg: P.Failed) -> None:
        w = self.workers[msg.worker]
        w.last_error = msg.message
        logger.error("worker %d failed to start: %s", w.index, msg.message)

    def _on_delta(self, msg: P.Delta) -> None:
        w, p, delta = self.workers[msg.worker], self.pending.get(msg.rid), msg.delta
        out = delta.output
        if p is None or p.worker != w.index:
            for held in delta.encoder_handles():  # nobody takes the handle: release it now
                self.send(w, P.ReleaseEncoder(held.id))
            return
        if delta.finished:
            del self.pending[msg.rid]
            w.inflight.discard(msg.rid)
            w.finished += 1
        if delta.encoder_kv is not None:  # a share_encoder request's first delta
            delta.encoder_kv = p.adopt(self.handles.adopt(w.index, w.generation,
                                                          delta.encoder_kv))
        if out is not None and out.encoder_kv is not None:  # keep_encoder
            out.encoder_kv = p.adopt(self.handles.adopt(w.index, w.generation, out.encoder_kv))
        p.put(delta)

    def _on_reject(self, msg: P.Reject) -> None:
        p = self.pending.pop(msg.rid, None)
        self.workers[msg.worker].inflight.discard(msg.rid)
        if p is not None:
            p.put(ValueError(msg.message))

    def _on_stats(self, msg: P.Stats) -> None:
        self.workers[msg.worker].stats = msg.stats

    def _on_reply(self, msg: P.Reply) -> None:
        _, fut = self.calls.pop(msg.call_id, (None, None))
        if fut is None:  # its worker died (and what it held with it)
            return
        value = msg.value
        if msg.ok:  # a held log-mel becomes the caller's (released when dropped)
            value = self.mels.adopt(msg.worker, self.workers[msg.worker].generation, value)
        try:
            if msg.ok:
                fut.set_result(value)
            else:
                fut.set_exception(ValueError(value) if msg.error_type == "ValueError" else
                                  RuntimeError(f"worker {msg.worker}: {msg.error_type}: "
                                               f"{value}"))
        except concurrent.futures.InvalidStateError:
            pass  # the caller gave up (cancelled); nobody takes the answer

    def _on_bye(self, msg: P.Bye) -> None:
        self.workers[msg.worker].ready = False

    def _check_procs(self) -> None:
        for w in self.workers:
            if w.proc is None or w.proc.poll() is None:
                continue
            rc = w.proc.returncode
            with self.lock:
                was_ready = w.ready
                w.ready, w.proc = False, None
                if w.down is not None:
                    w.down.close()
                    w.down = None
                self._fail_worker(w, WorkerLost(
                    f"engine worker {w.index} exited (code {rc}) while running this request; "
                    "it is being restarted, retry the request"))
            if self.closing:
                continue
            w.failed_starts = 0 if was_ready else w.failed_starts + 1
            if not self._started or w.failed_starts >= MAX_FAILED_STARTS:
                w.given_up = True
                w.last_error = w.last_error or f"exited with code {rc} before it was ready"
                logger.error("worker %d gave up: %s", w.index, w.last_error)
                continue
            logger.warning("worker %d exited (code %s); restarting", w.index, rc)
            w.restarts += 1
            self._spawn(w)

    def _fail_worker(self, w: WorkerState, error: WorkerLost) -> None:
        """Fail the requests and calls of ``w`` (caller holds the lock)."""
        for rid in list(w.inflight):
            p = self.pending.pop(rid, None)
            if p is not None:
                p.put(error)
                w.lost += 1
        w.inflight.clear()
        for call_id, (index, fut) in list(self.calls.items()):
            if index == w.index:
                del self.calls[call_id]
                fut.set_exception(error)
