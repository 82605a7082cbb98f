"""A long-form log-mel that stays where it was computed: the engine worker process (on its
device), referred to by id from the API process.

A 10-minute upload's log-mel is ``[128, ~60,000]`` float32 (30 MB). Computed by an engine
worker (:mod:`edserve.dp.features`), it used to come back to the API process and then go out
again one 30 s window (1.5 MB) per engine request: on the H200 ~0.2 s per long upload before
its first window, and ~1.5 MB of pickling, socket and staging copies per window on both sides.
Now the worker keeps it (:class:`~edserve.dp.mel_store.MelStore`) and answers a
:class:`HeldMel`: its shape and an id. Slicing one, as a window layout does
(:func:`~edserve.audio.mel.window_features`), gives a :class:`MelWindowRef`, a few integers
that travel as the request's ``encoder_input``; the worker holding the log-mel writes the
window out on its device when the request arrives (the same values as slicing the log-mel).

Lifetime: the API process's ``HeldMel`` (made by the data-parallel client, which knows the
worker) hands the log-mel back when :meth:`HeldMel.release` is called or when the object is
garbage-collected, whichever comes first; a worker that dies takes its log-mels with it (its
in-flight long-form requests fail, as any of its requests do).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edserve.audio.compact_mel import check_window, column_range


@dataclass(frozen=True)
class MelWindowRef:
    """The encoder input ``[n_mels, width]``: columns ``start .. stop`` of held log-mel
    ``mel_id``, then zeros up to ``width`` columns (``stop - start <= width``)."""

    mel_id: int
    n_mels: int
    start: int
    stop: int
    width: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop or self.stop - self.start > self.width:
            raise ValueError(f"bad log-mel window {self.start}:{self.stop} of width "
                             f"{self.width}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_mels, self.width)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)


@dataclass(frozen=True, eq=False)
class HeldMel:
    """A long-form log-mel ``[n_mels, frames]`` (float32) held by an engine worker as
    ``mel_id``. Supports ``.shape``, :meth:`window` (the ``silence`` layout's slice) and
    ``mel[:, a:b]`` (a :class:`MelWindowRef` of exactly those columns).

    ``on_release``: set by the API process's registry (``None`` in the worker's own answer):
    called once, by :meth:`release` or when this object is collected."""

    mel_id: int
    n_mels: int
    frames: int
    on_release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.on_release is not None:
            finalizer = weakref.finalize(self, self.on_release)
            finalizer.atexit = False  # at exit the workers go anyway
            object.__setattr__(self, "_finalizer", finalizer)

    def __reduce__(self) -> tuple:
        """Crosses a process boundary as its id and shape only (never its release hook)."""
        return (HeldMel, (self.mel_id, self.n_mels, self.frames))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_mels, self.frames)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def window(self, start: int, stop: int, width: int | None = None) -> MelWindowRef:
        """Columns ``start .. stop``, zero-padded to ``width`` (default ``stop - start``)."""
        check_window(start, stop, self.frames)
        width = stop - start if width is None else width
        return MelWindowRef(self.mel_id, self.n_mels, start, stop, width)

    def __getitem__(self, index: tuple) -> MelWindowRef:
        return self.window(*column_range(index, self.frames, "HeldMel"))

    def release(self) -> None:
        """Hand the log-mel back to its worker now (idempotent; no-op without a hook)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
