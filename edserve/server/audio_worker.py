"""The audio worker process: one job at a time from the API process's dispatcher
(:mod:`edserve.server.audio_dispatch`), over one zmq DEALER socket.

Protocol (the worker's messages pickled by :mod:`edserve.dp.wire`, arrays out of band; the
API process's job header by plain pickle):
  * worker -> API, once at start: ``("ready",)``;
  * API -> worker: ``(job_id, fn, ref, args, kwargs)`` and, when ``ref`` is None, the upload's
    bytes as a second frame (else ``ref`` is a :class:`~edserve.server.upload_slots.SlotRef`
    naming them in shared memory);
  * worker -> API: ``("done", job_id, ok, value)``: ``fn(upload, *args, **kwargs)``'s result,
    or (``ok`` False) the exception it raised.
A worker answers every job before it takes the next, so the API process knows which job a
dead worker held. It exits when its parent is gone.
"""

from __future__ import annotations

import os
import pickle
import signal

import zmq

from edserve.dp import wire
from edserve.server.upload_slots import SlotReader

#: How often (ms) an idle worker checks that the API process is still there.
_PARENT_CHECK_MS = 1000


def _answer(sock: zmq.Socket, job_id: int, ok: bool, value: object) -> None:
    try:
        wire.send(sock, ("done", job_id, ok, value))
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # an unpicklable result
        wire.send(sock, ("done", job_id, False,
                         RuntimeError(f"audio worker could not send its answer: {e!r}")))


def serve(endpoint: str, identity: bytes) -> None:
    """The worker's main: connect to ``endpoint`` as ``identity`` and run jobs until the
    parent process exits."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    torch.set_num_threads(1)  # the pool is the parallelism
    parent = os.getppid()
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    wire.send(sock, ("ready",))
    reader = SlotReader()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(_PARENT_CHECK_MS):
            if os.getppid() != parent:
                break
            continue
        frames = sock.recv_multipart(copy=False)
        job_id, fn, ref, args, kwargs = pickle.loads(frames[0].buffer)
        try:
            data = reader.read(ref) if ref is not None else frames[1].bytes
            value, ok = fn(data, *args, **kwargs), True
        except Exception as e:  # the upload's refusal (AudioError) or the job's failure
            value, ok = e, False
        _answer(sock, job_id, ok, value)
    sock.close()
    ctx.term()
