"""Messages on the wire between the API process and its workers: pickle, with host tensors
carried as numpy arrays.

A request carries its log-mel (large-v3: ``[128, 3000]`` float32, 1.5 MB). Pickling a torch
tensor goes through ``torch.save`` of its storage (2.0-2.8 ms to pickle and 0.9 ms to unpickle
one such log-mel on the dev box), and a view pickles its base's whole storage; a send and
receive through a local socket took 4.1 ms (10.2 ms from a window view) against 1.5 ms (2.1 ms)
this way. :func:`dumps` reduces every CPU tensor whose dtype
numpy has (and that needs no autograd) through numpy; anything else pickles as usual. A view
is sent as its own elements only (not its base's whole storage), and arrives contiguous.
:func:`send` ships the arrays out of band (pickle protocol 5 buffers as extra zmq frames), so
a contiguous log-mel is not copied on the sending side at all.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import numpy as np
import torch
import zmq

_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad \
            and type(t) is torch.Tensor:
        return _from_numpy, (np.ascontiguousarray(t.numpy()),)
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[torch.Tensor] = _reduce_tensor


def dumps(msg: Any, buffers: list[pickle.PickleBuffer] | None = None) -> bytes:
    """``msg`` pickled (protocol 5), host tensors as numpy arrays; with ``buffers``, their
    data is left out of the pickle and appended there (out-of-band), to be sent as is."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=5,
                             buffer_callback=None if buffers is None else buffers.append)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(msg)
    return buf.getvalue()


def encode(msg: Any) -> list:
    """One message's zmq frames: the pickle (:func:`dumps`), then each array's bytes straight
    from its memory (out of band: not copied into the pickle)."""
    buffers: list[pickle.PickleBuffer] = []
    head = dumps(msg, buffers)
    return [head, *(b.raw() for b in buffers)]


def send(socket: zmq.Socket, msg: Any, flags: int = 0) -> None:
    """Send one message (:func:`encode`; its frames as one zmq message); ``flags`` as
    ``zmq.Socket.send``'s."""
    socket.send_multipart(encode(msg), flags, copy=False)


def recv(socket: zmq.Socket, flags: int = 0) -> Any:
    """Receive one message sent by :func:`send` (raises ``zmq.Again`` with NOBLOCK and none);
    its arrays live in the received frames' (writable) memory, not copied again."""
    frames = socket.recv_multipart(flags, copy=False)
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
