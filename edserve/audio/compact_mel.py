"""A whole-audio log-mel without its constant tail, as an audio worker hands it over.

The long-form log-mel of a clip is its frames followed by 30 s of appended silence, whose
frames (from a little past the audio's end) all hold one value: ~73 % of an 11 s clip's
``[128, 4100]`` float32 (2.1 MB). :class:`CompactMel` keeps the columns before that run
(``head``) and the value once; slicing it (``mel[:, a:b]``, what a window layout does)
writes the requested columns straight into one new contiguous array, so the API process
neither rebuilds the whole log-mel nor copies a window twice. Values are bit-exact: the tail
is cut only where every entry has the same bits (:func:`split_tail`).
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
        rows, cols = index
        if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
            raise IndexError("CompactMel supports mel[:, a:b] only")
        start, stop, _ = cols.indices(self.frames)
        stop = max(start, stop)
        out = np.empty((self.head.shape[0], stop - start), dtype=self.head.dtype)
        split = min(max(self.head.shape[1] - start, 0), stop - start)  # columns from head
        out[:, :split] = self.head[:, start:start + split]
        out[:, split:] = self.fill
        return torch.from_numpy(out)  # [n_mels, stop - start]

    def full(self) -> torch.Tensor:
        """The whole log-mel ``[n_mels, frames]``."""
        return self[:, :]
