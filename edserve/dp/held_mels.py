"""The API process's side of held log-mels (:mod:`edserve.audio.held_mel`): which worker
incarnation holds each one, where a window's request must run, and the release message.

A ``features`` answer whose ``mel`` is a worker's :class:`HeldMel` is adopted on the I/O
thread as soon as it arrives (:meth:`HeldMels.adopt`): the caller gets a ``HeldMel`` with a
client id and a release hook, so an answer that nobody awaits any more (the caller was
cancelled) is released when it is dropped. A window's request is routed to the holding worker
with the worker's id (:meth:`HeldMels.route`); when that worker has restarted since, the
log-mel went with its process and the request fails with
:class:`~edserve.dp.errors.WorkerLost` (503), like the requests that were running there.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable

from edserve.audio.held_mel import HeldMel, MelWindowRef
from edserve.audio.prepare import PreparedAudio
from edserve.dp.errors import WorkerLost
from edserve.dp.handles import HandleRef

logger = logging.getLogger("edserve.dp")

# (worker slot, generation, the worker's mel id) -> sent the release (False: could not)
ReleaseSender = Callable[[int, int, int], bool]


class HeldMels:
    """Client id -> :class:`~edserve.dp.handles.HandleRef` of every held log-mel given out
    (thread-safe)."""

    def __init__(self, send_release: ReleaseSender) -> None:
        self._send_release = send_release
        self._refs: dict[int, HandleRef] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # a release can run from a collection, anywhere

    def __len__(self) -> int:
        return len(self._refs)

    def adopt(self, worker: int, generation: int, value: PreparedAudio) -> PreparedAudio:
        """``value`` (a features answer of worker ``worker``) with its held log-mel as the
        caller's :class:`HeldMel`; anything else unchanged."""
        if not isinstance(value, PreparedAudio) or not isinstance(value.mel, HeldMel):
            return value
        mel = value.mel
        with self._lock:
            client_id = next(self._ids)
            self._refs[client_id] = HandleRef(worker, generation, mel.mel_id)
        held = HeldMel(client_id, mel.n_mels, mel.frames,
                       on_release=lambda: self.release(client_id))
        return dataclasses.replace(value, mel=held)

    def route(self, ref: MelWindowRef, generation_of: Callable[[int], int | None]
              ) -> tuple[MelWindowRef, int]:
        """The window as its worker knows it, and that worker's slot. ``generation_of(slot)``:
        the slot's serving generation (None: not serving). ValueError for an id not held,
        :class:`WorkerLost` when the holding worker is gone."""
        held = self._refs.get(ref.mel_id)
        if held is None:
            raise ValueError(f"log-mel {ref.mel_id} is not held by this server "
                             "(released already?)")
        if generation_of(held.worker) != held.generation:
            raise WorkerLost(f"engine worker {held.worker} restarted; the log-mel of this "
                             "audio went with it; retry the request")
        return dataclasses.replace(ref, mel_id=held.worker_id), held.worker

    def release(self, client_id: int) -> None:
        """Forget ``client_id`` and tell its worker (logged when that worker is gone)."""
        with self._lock:
            held = self._refs.pop(client_id, None)
        if held is None:
            return
        if not self._send_release(held.worker, held.generation, held.worker_id):
            logger.info("release_mel: worker %d restarted (or is stopping); log-mel %d went "
                        "with its process", held.worker, client_id)
