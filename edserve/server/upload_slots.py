"""Uploads to the audio worker processes through shared memory: :class:`UploadSlots`.

Sending a job's upload through a socket or pipe costs the API process a copy into the message
and the writes (with ``ProcessPoolExecutor``, ``multiprocessing.Connection._send`` was ~13 % of
the API process's samples at 32 clients: an 11 s WAV is 352 KB, written 64 KB at a time). Here
the API process copies the upload once into a slot of a file in ``/dev/shm`` that every worker
maps, and the job message carries only ``(path, offset, length)``
(:mod:`edserve.server.audio_dispatch`).

Contract: :meth:`UploadSlots.put` returns a :class:`SlotRef` or None (upload larger than a
slot, every slot taken, or no shared memory on this host: the caller sends the bytes in the
message instead). A slot is the job's until :meth:`UploadSlots.free`, which the caller runs
once the worker holding the job has answered or died, so no worker ever reads a slot that is
being rewritten. ``put`` and ``free`` may run on different threads (a lock guards the free
list). :meth:`UploadSlots.close` unmaps and removes the file.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from dataclasses import dataclass

#: Slots and their size: uploads up to 1 MiB (a 30 s 16-bit WAV is 960 KB) in 32 slots, 32
#: MiB of /dev/shm at most (only the pages written are ever backed by memory).
SLOTS, SLOT_BYTES = 32, 1 << 20


@dataclass(frozen=True)
class SlotRef:
    """Where a worker finds an upload: ``length`` bytes at ``offset`` of the file ``path``."""

    path: str
    offset: int
    length: int
    slot: int


class UploadSlots:
    """``count`` slots of ``size`` bytes in one shared file (see the module docstring)."""

    def __init__(self, count: int = SLOTS, size: int = SLOT_BYTES,
                 folder: str | None = None) -> None:
        folder = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd, self.path = tempfile.mkstemp(prefix="edserve-uploads-", dir=folder)
        try:  # reserve the space now: a full tmpfs then fails here, not as SIGBUS on a write
            os.posix_fallocate(fd, 0, count * size)
            self._map = mmap.mmap(fd, count * size)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.size = size
        self._free = list(range(count))
        self._lock = threading.Lock()

    def put(self, data: bytes) -> SlotRef | None:
        """Copy ``data`` into a free slot; None if it does not fit or none is free."""
        if len(data) > self.size:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        offset = slot * self.size
        self._map[offset:offset + len(data)] = data
        return SlotRef(self.path, offset, len(data), slot)

    def free(self, ref: SlotRef) -> None:
        """Give ``ref``'s slot back (its job is done: no worker reads it any more)."""
        with self._lock:
            self._free.append(ref.slot)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SlotReader:
    """A worker's side: the shared files mapped once each, read by :class:`SlotRef`."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def read(self, ref: SlotRef) -> bytes:
        m = self._maps.get(ref.path)
        if m is None:
            with open(ref.path, "rb") as f:
                m = self._maps[ref.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m[ref.offset:ref.offset + ref.length]


def open_slots() -> UploadSlots | None:
    """Slots for a process pool, or None where the host has no room for them."""
    try:
        return UploadSlots()
    except OSError:
        return None
