"""Where uploads become features: a pool of audio worker processes (default), or threads.

Decoding (PyAV), resampling and the log-mel of an upload take ~25 ms of CPU for an 11 s clip;
in threads of the API process they serialize on its GIL with the event loop (measured on the
H200: 16 ms alone, ~800 ms per request at 32 concurrent). :class:`ProcessPreparer` runs
:func:`~edserve.audio.prepare.prepare_upload` in ``--audio-workers`` processes (forked from a
forkserver that has imported the audio stack once, one torch thread each): the API process
only sends the upload's bytes (through shared memory when they fit a slot,
:mod:`edserve.server.upload_slots`) and receives the log-mel (numpy, pickle protocol 5).
:class:`ThreadPreparer` (``--audio-workers 0``) keeps today's threads.

Contract of :meth:`AudioPreparer.prepare`: the :class:`~edserve.audio.prepare.PreparedAudio`
(or, for audio longer than the call's ``defer_above_s``, its
:class:`~edserve.audio.prepare.DecodedAudio`, whose log-mel the engine's device computes; the
threshold comes from :mod:`edserve.server.feature_policy`, per upload), or the upload's refusal
as the same ``AudioError`` that ``load_audio`` raises. Cancelling the awaiting coroutine (client
gone) drops a job not yet started (a thread job also stops between frames; a process job already
running finishes, bounded by ``--max-audio-seconds``). A worker process that dies (e.g. FFmpeg
crashing on a crafted file) fails the jobs then in the pool with :class:`AudioWorkerLost` (the
server answers 503); the pool is replaced, the server keeps serving.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from edserve.audio.prepare import DecodedAudio, PreparedAudio, prepare_upload
from edserve.server.upload_slots import SlotReader, SlotRef, UploadSlots, open_slots

#: Most worker processes ``--audio-workers auto`` starts.
MAX_AUTO_WORKERS = 8
_PRELOAD = ["edserve.audio.prepare"]


class AudioWorkerLost(RuntimeError):
    """An audio worker process died while this upload was in the pool (not the upload's
    fault, as far as the server can tell): retry."""


def auto_workers(cores: int | None = None) -> int:
    """``--audio-workers auto``: half the cores this process may use, 1 to
    :data:`MAX_AUTO_WORKERS` (the other half: the event loop, the engine thread, torch)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cores // 2))


class AudioPreparer(ABC):
    """Turns upload bytes into :class:`PreparedAudio` off the event loop (see module doc)."""

    def __init__(self, n_mels: int, job: Callable[..., PreparedAudio] = prepare_upload) -> None:
        self.n_mels = n_mels
        self.job = job  # (data, n_mels, max_seconds[, cancel]) -> PreparedAudio; tests swap it

    @staticmethod
    def _job_kwargs(defer_above_s: float | None) -> dict[str, float]:
        return {} if defer_above_s is None else {"defer_above_s": defer_above_s}

    @abstractmethod
    async def prepare(self, data: bytes, max_seconds: float | None, cancel: threading.Event,
                      defer_above_s: float | None = None) -> PreparedAudio | DecodedAudio:
        """``defer_above_s``: audio longer than this many seconds comes back as
        DecodedAudio, for the engine's device to compute its log-mel (None: never)."""

    @abstractmethod
    def start(self) -> None:
        """Start (and warm) the workers now rather than on the first upload."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (jobs in flight are abandoned)."""


class ThreadPreparer(AudioPreparer):
    """``--audio-workers 0``: the job in a thread of the API process (``cancel`` is checked
    between decoded frames)."""

    async def prepare(self, data: bytes, max_seconds: float | None, cancel: threading.Event,
                      defer_above_s: float | None = None) -> PreparedAudio | DecodedAudio:
        return await asyncio.to_thread(self.job, data, self.n_mels, max_seconds, cancel,
                                       **self._job_kwargs(defer_above_s))

    def start(self) -> None:
        return None  # the event loop's default executor starts its threads on demand

    def shutdown(self) -> None:
        return None


def _init_worker() -> None:
    """In each worker: one torch thread (the pool is the parallelism), Ctrl-C is the
    server's to handle."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


def _ready() -> int:
    return os.getpid()


_reader = SlotReader()  # in each worker process: the shared upload files it has mapped


def _from_slot(job: Callable[..., PreparedAudio], ref: SlotRef, *args, **kwargs
               ) -> PreparedAudio | DecodedAudio:
    """In a worker: ``job`` on the upload in shared-memory slot ``ref``."""
    return job(_reader.read(ref), *args, **kwargs)


class ProcessPreparer(AudioPreparer):
    """``workers`` processes (started on :meth:`start` or the first upload)."""

    def __init__(self, n_mels: int, workers: int,
                 job: Callable[..., PreparedAudio] = prepare_upload) -> None:
        if workers < 1:
            raise ValueError(f"a process pool needs >= 1 worker, got {workers}")
        super().__init__(n_mels, job)
        self.workers = workers
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._slots: UploadSlots | None = None  # made with the first pool (None: no room)
        self.restarts = 0  # pools replaced after a worker died

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(_PRELOAD)
                self._executor = ProcessPoolExecutor(self.workers, mp_context=ctx,
                                                     initializer=_init_worker)
                if self._slots is None:
                    self._slots = open_slots()
            return self._executor

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:  # the first job to see it replaces it
                self._executor = None
                self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        pool = self._pool()  # one job per worker at once: each starts its own process
        for fut in [pool.submit(_ready) for _ in range(self.workers)]:
            fut.result()

    async def prepare(self, data: bytes, max_seconds: float | None, cancel: threading.Event,
                      defer_above_s: float | None = None) -> PreparedAudio | DecodedAudio:
        pool = self._pool()
        slots = self._slots
        ref = slots.put(data) if slots is not None else None
        args = (self.n_mels, max_seconds)
        try:
            if ref is None:  # too large for a slot, or none free: the bytes go by pipe
                future = pool.submit(self.job, data, *args, **self._job_kwargs(defer_above_s))
            else:
                future = pool.submit(_from_slot, self.job, ref, *args,
                                     **self._job_kwargs(defer_above_s))
                # the slot is the job's until its future is done: then no worker reads it
                future.add_done_callback(lambda _, taken=ref: slots.free(taken))
                ref = None
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._replace(pool)
            raise AudioWorkerLost("an audio worker process died") from None
        finally:
            if ref is not None:  # submit itself failed
                slots.free(ref)

    def pids(self) -> list[int]:
        """The worker processes' ids (tests, diagnostics)."""
        pool = self._executor
        return [] if pool is None else list(getattr(pool, "_processes", {}) or {})

    def shutdown(self) -> None:
        with self._lock:
            pool, self._executor = self._executor, None
            slots, self._slots = self._slots, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if slots is not None:
            slots.close()


def make_preparer(workers: int | None, n_mels: int) -> AudioPreparer:
    """``--audio-workers``: None (auto) -> :func:`auto_workers` processes, 0 -> threads,
    N -> N processes."""
    if workers is None:
        workers = auto_workers()
    if workers < 0:
        raise ValueError(f"--audio-workers must be auto or >= 0, got {workers}")
    if workers == 0:
        return ThreadPreparer(n_mels)
    return ProcessPreparer(n_mels, workers)

