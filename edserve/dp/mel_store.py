"""The long-form log-mels an engine worker keeps for the API process
(:mod:`edserve.audio.held_mel`): put by the ``features`` threads, read by the engine loop when
a window's request arrives, dropped when the API process releases them.

Bounded by bytes (:data:`DEFAULT_MAX_BYTES`, or ``EDSERVE_HELD_MEL_BYTES`` in the worker's
environment: :func:`budget_from_env`; 0 holds none): a log-mel that does not fit is not held,
and the ``features`` call answers its values instead (the path before holding existed).
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass

import torch

from edserve.audio.held_mel import HeldMel, MelWindowRef

#: Bytes of log-mels held at once per worker: ~130 ten-minute large-v3 log-mels (30 MB each).
DEFAULT_MAX_BYTES = 4 << 30
BUDGET_ENV = "EDSERVE_HELD_MEL_BYTES"


def budget_from_env() -> int:
    """``EDSERVE_HELD_MEL_BYTES`` (bytes, >= 0) or :data:`DEFAULT_MAX_BYTES`; ValueError for
    anything else."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    if not raw.isdigit():
        raise ValueError(f"{BUDGET_ENV} must be a number of bytes >= 0, got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class _Entry:
    head: torch.Tensor  # [n_mels, t] float32, on the engine's device
    fill: float  # every column from t on
    frames: int


class MelStore:
    """Held log-mels by id (thread-safe)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, head: torch.Tensor, fill: float, frames: int) -> HeldMel | None:
        """Keep ``head`` ``[n_mels, t]`` (float32; every later column up to ``frames`` is
        ``fill``); its :class:`HeldMel`, or None when it would pass ``max_bytes``. The caller
        has waited for the stream that wrote ``head``."""
        if head.dim() != 2 or head.dtype != torch.float32 or head.shape[1] > frames:
            raise ValueError(f"a held log-mel is [n_mels, <= {frames}] float32, got "
                             f"{list(head.shape)} {head.dtype}")
        nbytes = head.numel() * head.element_size()
        with self._lock:
            if self.held_bytes + nbytes > self.max_bytes:
                return None
            self.held_bytes += nbytes
            mel_id = next(self._ids)
            self._entries[mel_id] = _Entry(head, fill, frames)
        return HeldMel(mel_id, head.shape[0], frames)

    def release(self, mel_id: int) -> bool:
        """Drop log-mel ``mel_id``; False when it is not held."""
        with self._lock:
            entry = self._entries.pop(mel_id, None)
            if entry is not None:
                self.held_bytes -= entry.head.numel() * entry.head.element_size()
        return entry is not None

    def window(self, ref: MelWindowRef) -> torch.Tensor:
        """``ref`` written out: ``[n_mels, width]`` float32 on the log-mel's device, columns
        ``start .. stop`` of the log-mel then zeros, on the calling thread's stream (no host
        wait). ValueError when the log-mel is not held or ``ref`` does not fit it."""
        with self._lock:
            entry = self._entries.get(ref.mel_id)
        if entry is None:
            raise ValueError(f"log-mel {ref.mel_id} is not held by this engine worker "
                             "(released already?)")
        head = entry.head
        if ref.n_mels != head.shape[0] or ref.stop > entry.frames:
            raise ValueError(f"window {ref.start}:{ref.stop} x {ref.n_mels} mels does not fit "
                             f"log-mel {ref.mel_id} ({head.shape[0]} x {entry.frames})")
        if head.is_cuda:  # freed later by a release: not reused before this stream's reads
            head.record_stream(torch.cuda.current_stream(head.device))
        out = torch.empty(ref.n_mels, ref.width, dtype=torch.float32, device=head.device)
        t = head.shape[1]
        from_head = max(0, min(ref.stop, t) - ref.start)  # columns [start, start + from_head)
        out[:, :from_head].copy_(head[:, ref.start:ref.start + from_head])
        out[:, from_head:ref.stop - ref.start].fill_(entry.fill)
        out[:, ref.stop - ref.start:].zero_()
        return out
