"""Encoder reuse under engine worker processes: a ``keep_encoder`` handle is an id valid on the
worker incarnation that made it, and a retry that passes it runs there.

The worker keeps the real :class:`~edserve.engine.request.EncoderKV` (its slots index that
worker's KV pool) in its scheduler's ``held`` and sends back an id-only view (:func:`id_view`:
no slots). The API process gives the caller a view of its own, with an id from one counter for
all workers (so ids never collide), and records the :class:`HandleRef`: the worker slot, that
slot's generation (restart count) and the worker's id. A request with ``encoder_kv`` is then
routed to that worker with the worker's id and without its ``encoder_input`` (its encoder
extent is the handle's: the views keep ``encoder_len`` and ``enc_region``, so the worker's
engine and an API-side check read them alike); when the worker has restarted or is not serving
(the KV died with its process) the handle is dropped and the request runs on any worker without
it, re-encoding its ``encoder_input`` (the client drops the input only once it knows the handle
will do: :meth:`~edserve.dp.client.DataParallelClient._route`). A request that passes a handle
and no ``encoder_input`` cannot re-encode and fails with
:class:`~edserve.dp.errors.WorkerLost` when its handle's worker restarted.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from edserve.engine.request import EncoderKV

logger = logging.getLogger("edserve.dp")


def id_view(handle: EncoderKV, handle_id: int) -> EncoderKV:
    """``handle`` without its slots (they mean nothing outside its worker), as ``handle_id``."""
    return EncoderKV(torch.empty(0, dtype=torch.long), handle.encoder_len, handle.enc_region,
                     id=handle_id)


@dataclass(frozen=True)
class HandleRef:
    """Where a client handle's encoder K/V lives."""

    worker: int  # worker slot index
    generation: int  # the slot's process generation that holds it
    worker_id: int  # the handle's id in that worker's ``scheduler.held``


class EncoderHandles:
    """Client handle id -> :class:`HandleRef` (thread-safe: the I/O thread adopts, callers
    resolve and release)."""

    def __init__(self) -> None:
        self._refs: dict[int, HandleRef] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._refs)

    def adopt(self, worker: int, generation: int, view: EncoderKV) -> EncoderKV:
        """Record worker ``worker``'s handle ``view``; returns the caller's handle."""
        with self._lock:
            client_id = next(self._ids)
            self._refs[client_id] = HandleRef(worker, generation, view.id)
        return id_view(view, client_id)

    def get(self, handle: EncoderKV) -> HandleRef:
        """The handle's ref; ValueError when it is not held here (released already, or from
        another client)."""
        ref = self._refs.get(handle.id)
        if ref is None:
            raise ValueError(f"encoder_kv handle {handle.id} is not held by this server "
                             "(released already?)")
        return ref

    def pop(self, handle: EncoderKV) -> HandleRef | None:
        """Forget ``handle``; its ref, or None (with a warning) when it was not held."""
        if not isinstance(handle, EncoderKV):
            raise TypeError(f"release_encoder takes an EncoderKV handle, got "
                            f"{type(handle).__name__}")
        with self._lock:
            ref = self._refs.pop(handle.id, None)
        if ref is None:
            logger.warning("release_encoder: handle %d is not held (released twice?)",
                           handle.id)
        return ref
