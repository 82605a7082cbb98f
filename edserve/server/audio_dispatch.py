"""Jobs to the audio worker processes from the event loop itself: :class:`WorkerPool`.

``concurrent.futures.ProcessPoolExecutor`` moves each job through two helper threads of the
API process (its manager thread, then a queue's feeder thread that pickles and writes the
pipe) and each result back through the manager thread and the loop's self-pipe: per upload,
four thread wake-ups contending for the API process's GIL (py-spy, CPU toy server at 32
clients: ``Connection._send`` / ``_recv``, ``select`` and ``Condition`` waits ~30 % of the API
process's samples). Here the event loop sends a job with one non-blocking zmq send (zmq's own
I/O thread, no GIL, writes the socket) and reads results from the zmq socket's file descriptor
registered with the loop (:meth:`asyncio.AbstractEventLoop.add_reader`): no Python thread.

Contract:
  * :meth:`submit` returns an asyncio future of ``fn(data, *args, **kwargs)`` run in a worker;
    its exception if ``fn`` raised; :class:`AudioWorkerLost` if the worker died while it held
    the job. A worker holds at most :data:`DEPTH` jobs (one running, one queued behind it);
    the rest wait in the loop, where cancelling the future drops the job; a job already sent
    finishes and its result is dropped.
  * A dead worker (its process sentinel becomes readable) fails only the jobs it held and is
    replaced at once (:attr:`restarts`). After :data:`MAX_FAILED_STARTS` workers in a row die
    before their first message, none is started again; when none is left the pool is
    :attr:`broken` (every job fails with AudioWorkerLost; the owner makes a new pool).
  * Uploads that fit a :class:`~edserve.server.upload_slots.UploadSlots` slot go through shared
    memory; the slot is freed when the worker answers or dies. Larger uploads are a zmq frame
    sent from the caller's buffer (no copy in Python).
  * The pool follows the running loop of its latest caller (one loop at a time: the server's;
    tests run one ``asyncio.run`` after another); jobs of a closed loop are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import multiprocessing
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from edserve.server.audio_worker import serve
from edserve.server.upload_slots import SlotRef, UploadSlots

#: Jobs sent to a worker at once: the one it runs and one queued behind it, so a worker
#: starts its next job without waiting for the event loop to read its answer.
DEPTH = 2
#: Workers in a row that may die before their first message before no more are started.
MAX_FAILED_STARTS = 3
#: How long :meth:`WorkerPool.start` waits for every worker's first message.
START_TIMEOUT_S = 120.0


class AudioWorkerLost(RuntimeError):
    """An audio worker process died while this upload was in it (not the upload's fault, as
    far as the server can tell): retry."""


@dataclass(eq=False)
class _Job:
    id: int
    fn: Any
    data: bytes
    args: tuple
    kwargs: dict
    future: asyncio.Future
    slot: SlotRef | None = None

    def dropped(self) -> bool:
        """Nobody can receive this job's result any more."""
        return self.future.done() or self.future.get_loop().is_closed()


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    identity: bytes
    jobs: collections.deque = field(default_factory=collections.deque)  # sent, oldest first
    ready: bool = False


class WorkerPool:
    """``workers`` audio worker processes fed from the event loop (see the module doc)."""

    def __init__(self, workers: int, preload: list[str], slots: UploadSlots | None) -> None:
        self.workers = workers
        self.restarts = 0
        self._slots = slots
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(preload)
        self._dir = tempfile.mkdtemp(prefix="edserve-audio-")
        self._endpoint = f"ipc://{self._dir}/jobs"
        # one zmq I/O thread per worker connection (up to 4): a long-form upload (19 MB) and
        # its decoded samples (38 MB) cross the socket there, not on the event loop
        self._ctx = zmq.Context(max(1, min(4, workers)))
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises
        self._sock.bind(self._endpoint)
        self._fd = self._sock.getsockopt(zmq.FD)
        self._names = itertools.count()
        self._ids = itertools.count()
        self._by_identity: dict[bytes, _Worker] = {}
        self._pending: collections.deque[_Job] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._failed_starts = 0  # workers in a row that died before saying ready
        self.broken = False  # no worker left and none could start: make a new pool
        for _ in range(workers):
            self._spawn()

    # ---- processes

    def _spawn(self) -> _Worker:
        identity = f"audio-{next(self._names)}".encode()
        proc = self._mp.Process(target=serve, args=(self._endpoint, identity), daemon=True,
                                name=identity.decode())
        proc.start()
        w = _Worker(proc, identity)
        self._by_identity[identity] = w
        self._watch(w)
        return w

    def _live_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the pool is bound to, unless there is none or it is closed."""
        loop = self._loop
        return None if loop is None or loop.is_closed() else loop

    def _watch(self, w: _Worker) -> None:
        """Watch ``w``'s process sentinel from the bound loop (if any)."""
        if (loop := self._live_loop()) is not None:
            loop.add_reader(w.process.sentinel, self._died, w)

    def _unwatch(self, w: _Worker) -> None:
        if (loop := self._live_loop()) is not None:
            loop.remove_reader(w.process.sentinel)

    def _died(self, w: _Worker) -> None:
        """``w``'s process ended: fail the job it held, replace it."""
        self._unwatch(w)
        w.process.join(0)
        self._by_identity.pop(w.identity, None)
        if self._closed:
            return
        self.restarts += 1
        while w.jobs:  # the job it ran and the one queued behind it
            self._finish(w.jobs.popleft(), False,
                         AudioWorkerLost("an audio worker process died"))
        self._failed_starts = 0 if w.ready else self._failed_starts + 1
        if self._failed_starts < MAX_FAILED_STARTS:
            self._spawn()
        elif not self._by_identity:  # none left and none can start: fail what waits
            self.broken = True
            while self._pending:
                self._finish(self._pending.popleft(), False,
                             AudioWorkerLost("audio worker processes exit before they start"))

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until every worker has said it is ready (call outside the event loop)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while sum(w.ready for w in self._by_identity.values()) < self.workers:
            left = deadline - time.monotonic()
            dead = [w for w in self._by_identity.values() if not w.process.is_alive()]
            if left <= 0 or dead:
                raise RuntimeError(f"audio workers did not start (exit codes "
                                   f"{[w.process.exitcode for w in dead]})")
            if poller.poll(min(left, 0.5) * 1000):
                self._drain_now()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._by_identity.values()]

    # ---- jobs

    def submit(self, fn: Any, data: bytes, args: tuple, kwargs: dict) -> asyncio.Future:
        """Queue ``fn(data, *args, **kwargs)`` for a worker (call on the event loop)."""
        loop = asyncio.get_running_loop()
        self._bind(loop)
        job = _Job(next(self._ids), fn, data, args, kwargs, loop.create_future())
        if self.broken:
            job.future.set_exception(AudioWorkerLost("the audio workers cannot start"))
            return job.future
        self._pending.append(job)
        self._dispatch()
        return job.future

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the socket and the workers from ``loop`` (the caller's) from now on."""
        if loop is self._loop:
            return
        if (old := self._live_loop()) is not None:
            old.remove_reader(self._fd)
        for w in self._by_identity.values():
            self._unwatch(w)  # from the old loop
        self._loop = loop
        for w in self._by_identity.values():
            self._watch(w)
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # messages that came while no loop watched

    def _dispatch(self) -> None:
        sent = False
        while self._pending:
            w = min((w for w in self._by_identity.values() if w.ready), default=None,
                    key=lambda w: len(w.jobs))
            if w is None or len(w.jobs) >= DEPTH:
                break
            job = self._pending.popleft()
            if job.dropped():
                continue
            job.slot = self._slots.put(job.data) if self._slots is not None else None
            head = pickle.dumps((job.id, job.fn, job.slot, job.args, job.kwargs), protocol=5)
            frames = [w.identity, head] if job.slot is not None else \
                [w.identity, head, job.data]
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # the worker is gone: its sentinel reports it
                self._pending.appendleft(job)
                self._free_slot(job)
                w.ready = False
                continue
            w.jobs.append(job)
            sent = True
        if sent and self._loop is not None:
            self._loop.call_soon(self._drain)  # a send may consume the fd's edge

    def _drain(self) -> None:
        self._drain_now()
        self._dispatch()

    def _drain_now(self) -> None:
        """Handle every message waiting on the socket (the fd is edge-triggered)."""
        while not self._closed:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            w = self._by_identity.get(frames[0].bytes)
            msg = pickle.loads(frames[1].buffer, buffers=[f.buffer for f in frames[2:]])
            if w is None:  # a worker already counted as dead
                continue
            if msg[0] == "done" and w.jobs and w.jobs[0].id == msg[1]:
                self._finish(w.jobs.popleft(), msg[2], msg[3])
            w.ready = True

    def _finish(self, job: _Job, ok: bool, value: Any) -> None:
        self._free_slot(job)
        if job.dropped():
            return
        if ok:
            job.future.set_result(value)
        else:
            job.future.set_exception(value)

    def _free_slot(self, job: _Job) -> None:
        if job.slot is not None and self._slots is not None:
            self._slots.free(job.slot)
        job.slot = None

    def shutdown(self) -> None:
        """Stop the workers; jobs not answered yet fail with AudioWorkerLost."""
        if self._closed:
            return
        self._closed = True
        if (loop := self._live_loop()) is not None:
            try:
                loop.remove_reader(self._fd)
            except RuntimeError:  # called from outside a loop that is shutting down
                pass
        workers = list(self._by_identity.values())
        for w in workers:
            self._unwatch(w)
            w.process.terminate()
        for w in workers:
            w.process.join(5)
            while w.jobs:
                self._finish(w.jobs.popleft(), False,
                             AudioWorkerLost("the audio workers were stopped"))
        self._by_identity.clear()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
