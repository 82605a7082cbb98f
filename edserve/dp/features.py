"""Long uploads' log-mels in an engine worker, beside its engine loop: the ``features`` call.

The engine loop runs other calls between two steps; a 10-minute file's log-mel (copies in and
out, STFT, filterbank) would hold a step back by tens of milliseconds, so
:class:`FeatureService` runs them on a thread of its own, on a CUDA stream of its own when the
engine is on a GPU (the engine's steps keep going; the thread's waits release the GIL). The
thread answers through its own PUSH socket on the ``up`` endpoint (a zmq socket belongs to one
thread): a :class:`~edserve.dp.protocol.Reply` with the
:class:`~edserve.audio.prepare.PreparedAudio`, or the error.
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

logger = logging.getLogger("edserve.dp")


class FeatureService:
    """``submit(call_id, audio)`` queues one job; :meth:`close` stops the thread after the
    queued jobs. ``n_mels`` None: the model takes no log-mels (every job is refused)."""

    def __init__(self, index: int, ctx: zmq.Context, up_endpoint: str, device: torch.device,
                 n_mels: int | None) -> None:
        self.index, self.device, self.n_mels = index, device, n_mels
        self._jobs: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._socket = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 5000)
        self._socket.connect(up_endpoint)
        self._thread = threading.Thread(target=self._run, name="features", daemon=True)
        self._thread.start()

    def submit(self, call_id: int, audio: Any) -> None:
        self._jobs.put((call_id, audio))

    def _answer(self, call_id: int, audio: Any, stream: torch.cuda.Stream | None) -> P.Reply:
        try:
            if self.n_mels is None:
                raise ValueError("this model takes no audio features")
            if not isinstance(audio, DecodedAudio):
                raise TypeError(f"features takes DecodedAudio, got {type(audio).__name__}")
            value = device_features(audio, self.n_mels, self.device, stream)
        except Exception as exc:
            logger.warning("features call %d failed: %s: %s", call_id, type(exc).__name__, exc)
            return P.Reply(self.index, call_id, False, str(exc), type(exc).__name__)
        return P.Reply(self.index, call_id, True, value)

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            while (job := self._jobs.get()) is not None:
                wire.send(self._socket, self._answer(*job, stream))
        finally:
            self._socket.close()

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
