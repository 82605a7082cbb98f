"""Long uploads' log-mels in an engine worker, beside its engine loop: the ``features`` call.

The engine loop runs other calls between two steps; a 10-minute file's log-mel (copies in and
out, STFT, filterbank) would hold a step back by tens of milliseconds, so
:class:`FeatureService` runs them on threads of their own, each on a CUDA stream of its own when
the engine is on a GPU (the engine's steps keep going; the threads' waits release the GIL). On a
GPU a job is mostly its two copies (~26 ms per 10-minute file on the H200, 16 such uploads at
once waited ~0.2 s each behind one thread), so jobs run :data:`CUDA_THREADS` at a time there; on
a CPU one thread, beside the engine's own. Each thread answers through its own PUSH socket on
the ``up`` endpoint (a zmq socket belongs to one thread): a
:class:`~edserve.dp.protocol.Reply` with the :class:`~edserve.audio.prepare.PreparedAudio`, or
the error. With a :class:`~edserve.dp.mel_store.MelStore` the log-mel stays here, on the
engine's device, and the answer's ``mel`` is a :class:`~edserve.audio.held_mel.HeldMel` (its
id; windows refer to it, :mod:`edserve.audio.held_mel`); one that does not fit the store comes
back as values.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch
import zmq

from edserve.audio.device_mel import device_features
from edserve.audio.prepare import DecodedAudio
from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.dp.mel_store import MelStore

logger = logging.getLogger("edserve.dp")

#: Feature jobs run at once on a CUDA engine (one thread, one stream and one socket each).
CUDA_THREADS = 4


class FeatureService:
    """``submit(call_id, audio)`` queues one job; :meth:`close` stops the threads after the
    queued jobs. ``n_mels`` None: the model takes no log-mels (every job is refused).
    ``threads``: jobs at once (default :data:`CUDA_THREADS` on CUDA, else 1). ``store``: where
    log-mels are kept for the API process (None: every answer carries the values)."""

    def __init__(self, index: int, ctx: zmq.Context, up_endpoint: str, device: torch.device,
                 n_mels: int | None, threads: int | None = None,
                 store: MelStore | None = None) -> None:
        self.index, self.device, self.n_mels, self.store = index, device, n_mels, store
        if threads is None:
            threads = CUDA_THREADS if device.type == "cuda" else 1
        if threads < 1:
            raise ValueError(f"FeatureService needs >= 1 thread, got {threads}")
        self._jobs: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._threads = []
        for i in range(threads):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(up_endpoint)
            t = threading.Thread(target=self._run, args=(sock,), name=f"features-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, call_id: int, audio: Any) -> None:
        self._jobs.put((call_id, audio))

    def _answer(self, call_id: int, audio: Any, stream: torch.cuda.Stream | None) -> P.Reply:
        try:
            if self.n_mels is None:
                raise ValueError("this model takes no audio features")
            if not isinstance(audio, DecodedAudio):
                raise TypeError(f"features takes DecodedAudio, got {type(audio).__name__}")
            keep = self.store.hold if self.store is not None else None
            value = device_features(audio, self.n_mels, self.device, stream, keep=keep)
        except Exception as exc:
            logger.warning("features call %d failed: %s: %s", call_id, type(exc).__name__, exc)
            return P.Reply(self.index, call_id, False, str(exc), type(exc).__name__)
        return P.Reply(self.index, call_id, True, value)

    def _run(self, sock: zmq.Socket) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            while (job := self._jobs.get()) is not None:
                wire.send(sock, self._answer(*job, stream))
        finally:
            sock.close()

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)
