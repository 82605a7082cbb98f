"""Whisper log-mels staged in page-locked memory when a request is submitted (CUDA).

A prefill step uploads every admitted clip's log-mel (large-v3: ``[128, 3000]`` float32, 1.5
MB). Gathering them into one page-locked buffer on the stepping thread is a host memory pass
while the GPU waits (measured under arrivals on an H200: ~0.35 ms per clip,
``benchmarks/gpu_idle.py``). :class:`MelStager` makes that copy where the request is submitted
(the API thread in a server), so the step only issues one asynchronous copy per clip.

A window may arrive compact (:class:`~edserve.audio.compact_mel.CompactMel`: its head
columns and the silence's one value, as the API process sends it to an engine process); it is
written out here, once, into the page-locked copy (or a plain tensor where nothing is staged):
the model's other entry points see tensors only.

Bounded: at most ``max_bytes`` of staged log-mels are alive at once (a request holds its copy
until its encoder has run); past that a log-mel stays where it is and the step stages it as
before. The count follows the copies' lifetimes (``weakref.finalize``), so an aborted request
gives its share back when it is dropped.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edserve.audio.compact_mel import CompactMel

DEFAULT_MAX_BYTES = 512 << 20  # ~340 large-v3 log-mels waiting at once


class MelStager:
    """Page-locked copies of host log-mels, for a model on a CUDA device (thread-safe)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.staged_bytes = 0
        self._lock = threading.Lock()
        # id() of the copies made here and still alive (Tensor.is_pinned() asks the driver:
        # ~0.1 ms; a WeakSet would compare tensors with ==)
        self._staged: set[int] = set()

    def __reduce__(self) -> tuple:
        """Copies (``copy.deepcopy`` of a model, pickling) start with nothing staged."""
        return (MelStager, (self.max_bytes,))

    def is_staged(self, t: Any) -> bool:
        """``t`` is a live copy made by :meth:`stage` (page-locked)."""
        return id(t) in self._staged

    def stage(self, mel: torch.Tensor | CompactMel, device: torch.device) -> torch.Tensor:
        """``mel`` as a page-locked host copy (same shape, dtype and values) when ``device`` is
        CUDA, ``mel`` a host tensor or CompactMel not staged already and the budget allows;
        else ``mel`` itself (a CompactMel: written out as a plain tensor)."""
        compact = isinstance(mel, CompactMel)
        if device.type != "cuda" or not (compact or torch.is_tensor(mel)) \
                or (not compact and (mel.device.type != "cpu" or mel.requires_grad)) \
                or id(mel) in self._staged:
            return as_tensor(mel)
        dtype = torch.from_numpy(mel.head[:0, :0]).dtype if compact else mel.dtype
        pinned = self.pinned_empty(tuple(mel.shape), dtype)
        if pinned is None:
            return as_tensor(mel)
        if compact:
            mel.write_to(pinned.numpy())  # the window written out once, here
        elif mel.dtype in (torch.float32, torch.float16):
            pinned.numpy()[...] = mel.numpy()  # one memcpy on this thread (no intra-op team)
        else:
            pinned.copy_(mel)
        return pinned

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new page-locked tensor counted against ``max_bytes`` until it is dropped (and
        then :meth:`is_staged`), or None when the budget has no room for it."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        with self._lock:
            if self.staged_bytes + n > self.max_bytes:
                return None
            self.staged_bytes += n
        pinned = torch.empty(shape, dtype=dtype, pin_memory=True)
        with self._lock:
            self._staged.add(id(pinned))
        weakref.finalize(pinned, self._release, id(pinned), n)
        return pinned

    def _release(self, ident: int, n: int) -> None:
        with self._lock:
            self.staged_bytes -= n
            self._staged.discard(ident)


def as_tensor(mel: torch.Tensor | CompactMel) -> torch.Tensor:
    """A CompactMel written out as a host tensor; a tensor as it is."""
    return mel.full() if isinstance(mel, CompactMel) else mel


def host_finite(mel: torch.Tensor | CompactMel) -> bool:
    """No NaN/inf in a host log-mel. float32/float16 are read by numpy on the calling thread
    (this runs on the API's event loop: torch's kernels would wake their intra-op thread
    team, ~1.5 ms of process CPU per [80, 3000] log-mel with 2 threads vs 0.07 ms); a
    CompactMel's head and fill only."""
    if isinstance(mel, CompactMel):
        return mel.all_finite()
    if mel.dtype in (torch.float32, torch.float16) and not mel.requires_grad:
        return bool(np.isfinite(mel.numpy()).all())
    return bool(torch.isfinite(mel).all())


def mels_to_device(mels: list[torch.Tensor], device: torch.device,
                   staged: Callable[[torch.Tensor], bool] = lambda m: False) -> torch.Tensor:
    """``torch.stack(mels)`` on ``device``. On CUDA, log-mels that were staged at submission
    (``staged(m)``: page-locked) go up by one non-blocking copy each; other host log-mels are
    stacked straight into one page-locked buffer and uploaded by one non-blocking copy (a copy
    from pageable memory would make the host wait for the device). PyTorch's caching host
    allocator keeps page-locked memory alive until the copies from it have run."""
    if device.type != "cuda" or all(m.device == device for m in mels):
        return torch.stack([m.to(device) for m in mels])
    if all(m.device == device or staged(m) for m in mels):
        # staged at submission (MelStager): one asynchronous copy each, no host pass here
        dtype = functools.reduce(torch.promote_types, (m.dtype for m in mels))
        out = torch.empty((len(mels), *mels[0].shape), dtype=dtype, device=device)
        for row, m in zip(out, mels, strict=True):
            row.copy_(m, non_blocking=True)
        return out
    if any(m.device.type != "cpu" for m in mels):  # some already on a device: one copy each
        return torch.stack([m.pin_memory().to(device, non_blocking=True)
                            if m.device.type == "cpu" else m.to(device) for m in mels])
    host = torch.empty((len(mels), *mels[0].shape), dtype=mels[0].dtype, pin_memory=True)
    torch.stack(mels, out=host)
    return host.to(device, non_blocking=True)
