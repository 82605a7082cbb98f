"""A whole-audio log-mel without its constant tail, as an audio worker hands it over.

The long-form log-mel of a clip is its frames followed by 30 s of appended silence, whose
frames (from a little past the audio's end) all hold one value: ~73 % of an 11 s clip's
``[128, 4100]`` float32 (2.1 MB). :class:`CompactMel` keeps the columns before that run
(``head``) and the value once; slicing it (``mel[:, a:b]``, what a window layout does)
writes the requested columns straight into one new contiguous array, so the API process
neither rebuilds the whole log-mel nor copies a window twice. Values are bit-exact: the tail
is cut only where every entry has the same bits (:func:`split_tail`). A request's 30 s window
is one too (:meth:`CompactMel.window`): the engine writes it out where it stages the upload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def split_tail(mel: np.ndarray) -> tuple[np.ndarray, np.generic | float]:
    """``mel`` ``[n_mels, T]`` as ``(mel[:, :t], v)``: the longest run of last columns whose
    every entry is ``v`` (the last entry) is cut off; exact (the bits are compared)."""
    if not mel.size or mel.dtype.kind != "f":
        return mel, 0.0
    bits = mel.view(f"u{mel.itemsize}")  # [n_mels, T] the same bytes as unsigned integers
    differs = np.flatnonzero(~(bits == bits[-1, -1]).all(axis=0))  # [columns with others]
    fill = mel[-1, -1].copy()  # a numpy scalar: pickled and written back with its bits
    cut = int(differs[-1]) + 1 if differs.size else 0
    return np.ascontiguousarray(mel[:, :cut]), fill


def column_range(index: tuple, frames: int, kind: str) -> tuple[int, int]:
    """``mel[:, a:b]``'s ``(start, stop)`` over ``frames`` columns (Python slice rules, empty
    when ``b <= a``); IndexError for any other index of a ``kind`` log-mel."""
    rows, cols = index
    if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
        raise IndexError(f"{kind} supports mel[:, a:b] only")
    start, stop, _ = cols.indices(frames)
    return start, max(start, stop)


def check_window(start: int, stop: int, frames: int) -> None:
    """IndexError unless columns ``start .. stop`` lie within ``frames``."""
    if not 0 <= start <= stop <= frames:
        raise IndexError(f"window {start}:{stop} of a {frames}-frame log-mel")


@dataclass(frozen=True, eq=False)
class CompactMel:
    """``[n_mels, frames]``: columns ``0 .. head.shape[1]`` are ``head``, every later entry
    is ``fill``. Supports ``.shape``, ``mel[:, a:b]`` (a new contiguous float tensor) and
    :meth:`full`."""

    head: np.ndarray  # [n_mels, t]
    fill: np.generic | float
    frames: int

    @classmethod
    def of(cls, mel: np.ndarray) -> CompactMel:
        head, fill = split_tail(mel)
        return cls(head, fill, mel.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.head.shape[0], self.frames)

    def __getitem__(self, index: tuple) -> torch.Tensor:
        start, stop = column_range(index, self.frames, "CompactMel")
        out = np.empty((self.head.shape[0], stop - start), dtype=self.head.dtype)
        split = min(max(self.head.shape[1] - start, 0), stop - start)  # columns from head
        out[:, :split] = self.head[:, start:start + split]
        out[:, split:] = self.fill
        return torch.from_numpy(out)  # [n_mels, stop - start]

    @property
    def dtype(self) -> np.dtype:
        return self.head.dtype

    def full(self) -> torch.Tensor:
        """The whole log-mel ``[n_mels, frames]``."""
        return self[:, :]

    def window(self, start: int, stop: int) -> CompactMel:
        """Columns ``start .. stop`` as a CompactMel: the same values as ``mel[:, start:stop]``
        without writing them out (its head is a view of this head, the fill is shared). A
        window crosses a process boundary this way (an 11 s clip's 30 s window: its 1,100 head
        columns instead of 3,000) and is written out once, where it is used
        (:meth:`write_to`)."""
        check_window(start, stop, self.frames)
        t = self.head.shape[1]
        return CompactMel(self.head[:, min(start, t):min(stop, t)], self.fill, stop - start)

    def write_to(self, out: np.ndarray) -> np.ndarray:
        """Every value into ``out`` ``[n_mels, frames]`` (e.g. page-locked memory); returns it."""
        t = self.head.shape[1]
        out[:, :t] = self.head
        out[:, t:] = self.fill
        return out

    def all_finite(self) -> bool:
        """No NaN or infinity among the values."""
        return bool(np.isfinite(self.fill)) and bool(np.isfinite(self.head).all())
