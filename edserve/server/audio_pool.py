"""Where uploads become features: a pool of audio worker processes (default), or threads.

Decoding (PyAV), resampling and the log-mel of an upload take ~25 ms of CPU for an 11 s clip;
in threads of the API process they serialize on its GIL with the event loop (measured on the
H200: 16 ms alone, ~800 ms per request at 32 concurrent). :class:`ProcessPreparer` runs
:func:`~edserve.audio.prepare.prepare_upload` in ``--audio-workers`` processes (forked from a
forkserver that has imported the audio stack once, one torch thread each; jobs sent from the
event loop itself, :mod:`edserve.server.audio_dispatch`): the API process only sends the
upload's bytes (through shared memory when they fit a slot, :mod:`edserve.server.upload_slots`)
and receives the log-mel (numpy, pickle protocol 5).
:class:`ThreadPreparer` (``--audio-workers 0``) keeps today's threads.

Contract of :meth:`AudioPreparer.prepare`: the :class:`~edserve.audio.prepare.PreparedAudio`
(or, for audio longer than the call's ``defer_above_s``, its
:class:`~edserve.audio.prepare.DecodedAudio`, whose log-mel the engine's device computes; the
threshold comes from :mod:`edserve.server.feature_policy`, per upload), or the upload's refusal
as the same ``AudioError`` that ``load_audio`` raises. Cancelling the awaiting coroutine (client
gone) drops a job not yet sent to a worker (a thread job also stops between frames; a process
job already sent finishes, bounded by ``--max-audio-seconds``, and its result is dropped). A
worker process that dies (e.g. FFmpeg crashing on a crafted file) fails the jobs it held with
:class:`AudioWorkerLost` (the server answers 503); that worker is replaced, the others keep their
jobs, the server keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from edserve.audio.prepare import DecodedAudio, PreparedAudio, prepare_upload
from edserve.server.audio_dispatch import AudioWorkerLost, WorkerPool
from edserve.server.upload_slots import UploadSlots, open_slots

__all__ = ["AudioPreparer", "AudioWorkerLost", "ProcessPreparer", "ThreadPreparer",
           "auto_workers", "make_preparer"]

#: Most worker processes ``--audio-workers auto`` starts.
MAX_AUTO_WORKERS = 8
_PRELOAD = ["edserve.audio.prepare", "edserve.server.audio_worker"]


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


class ProcessPreparer(AudioPreparer):
    """``workers`` processes (started on :meth:`start` or the first upload), fed from the
    event loop by :class:`~edserve.server.audio_dispatch.WorkerPool`."""

    def __init__(self, n_mels: int, workers: int,
                 job: Callable[..., PreparedAudio] = prepare_upload) -> None:
        if workers < 1:
            raise ValueError(f"a process pool needs >= 1 worker, got {workers}")
        super().__init__(n_mels, job)
        self.workers = workers
        self._lock = threading.Lock()
        self._workers: WorkerPool | None = None
        self._slots: UploadSlots | None = None  # made with the pool (None: no room)

    def _pool(self) -> WorkerPool:
        with self._lock:
            if self._workers is not None and self._workers.broken:  # try a new one
                self._workers.shutdown()
                self._workers = None
            if self._workers is None:
                if self._slots is None:
                    self._slots = open_slots()
                self._workers = WorkerPool(self.workers, _PRELOAD, self._slots)
            return self._workers

    @property
    def restarts(self) -> int:
        """Workers replaced after one died."""
        return 0 if self._workers is None else self._workers.restarts

    def start(self) -> None:
        self._pool().start()

    async def prepare(self, data: bytes, max_seconds: float | None, cancel: threading.Event,
                      defer_above_s: float | None = None) -> PreparedAudio | DecodedAudio:
        return await self._pool().submit(self.job, data, (self.n_mels, max_seconds),
                                         self._job_kwargs(defer_above_s))

    def pids(self) -> list[int]:
        """The worker processes' ids (tests, diagnostics)."""
        return [] if self._workers is None else self._workers.pids()

    def shutdown(self) -> None:
        with self._lock:
            pool, self._workers = self._workers, None
            slots, self._slots = self._slots, None
        if pool is not None:
            pool.shutdown()
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

