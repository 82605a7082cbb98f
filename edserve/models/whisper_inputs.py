"""What a Whisper request's ``encoder_input`` may be, and how a prefill step's inputs reach
the device as one ``[N, n_mels, 3000]`` float32 batch.

Three forms (:class:`WhisperInputs`):

- a log-mel tensor ``[n_mels, 3000]`` (host or device);
- a :class:`~edserve.audio.compact_mel.CompactMel` window (as the API process sends one);
- a :class:`~edserve.audio.pcm_window.PcmWindow`: a short clip's samples, whose log-mel the
  step computes with the other such clips' (:mod:`edserve.models.step_mel`).

Contracts: :meth:`WhisperInputs.check` raises ValueError for anything else, a wrong shape or
mel count, or non-finite host values (no device read: no sync); :meth:`WhisperInputs.stage`
runs at submission (any thread) and makes the step's upload one non-blocking copy per input
on CUDA; :meth:`WhisperInputs.to_device` keeps the inputs' order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edserve.audio.compact_mel import CompactMel
from edserve.audio.mel import mel_filters
from edserve.audio.pcm_window import PcmWindow
from edserve.models.mel_staging import MelStager, host_finite, mels_to_device
from edserve.models.step_mel import stage_pcm, window_log_mels


class WhisperInputs:
    """Validation, staging and upload of one model's encoder inputs (``n_mels`` bins,
    ``frames`` columns)."""

    def __init__(self, n_mels: int, frames: int) -> None:
        self.n_mels, self.frames = n_mels, frames
        self.stager = MelStager()  # page-locked log-mels at submission (CUDA)
        self._filters: dict[torch.device, torch.Tensor] = {}  # mel filterbank per device

    def __reduce__(self) -> tuple:
        """Copies (``copy.deepcopy`` of a model) start with nothing staged or cached."""
        return (WhisperInputs, (self.n_mels, self.frames))

    def check(self, x: Any) -> None:
        """ValueError unless ``x`` is a valid encoder input (see the module doc)."""
        if isinstance(x, PcmWindow):
            if x.n_mels != self.n_mels:
                raise ValueError(f"PCM window for {x.n_mels} mel bins, the model takes "
                                 f"{self.n_mels}")
            if isinstance(x.samples, np.ndarray) and x.samples.dtype == np.float32 \
                    and not np.isfinite(x.samples).all():
                raise ValueError("PCM samples contain NaN or infinite values")
            return
        self.check_mel(x)
        on_host = isinstance(x, CompactMel) or x.device.type == "cpu"
        if on_host and not host_finite(x):
            raise ValueError("Whisper log-mel contains NaN or infinite values")

    def check_mel(self, mel: Any) -> None:
        """Shape and dtype of a log-mel tensor or CompactMel window (no values read)."""
        expected = (self.n_mels, self.frames)
        compact = isinstance(mel, CompactMel)
        if not (compact or torch.is_tensor(mel)) or tuple(mel.shape) != expected \
                or not (mel.dtype.kind == "f" if compact else mel.dtype.is_floating_point):
            got = f"{list(mel.shape)} {mel.dtype}" if compact or torch.is_tensor(mel) \
                else type(mel).__name__
            raise ValueError(f"Whisper expects a floating-point log-mel tensor of shape "
                             f"{list(expected)} or a PcmWindow, got {got}")

    def stage(self, x: Any, device: torch.device) -> Any:
        """``x`` ready for a fast upload to ``device``: on CUDA a page-locked copy (a log-mel:
        :class:`~edserve.models.mel_staging.MelStager`; a PCM window: its samples), elsewhere
        ``x`` (a CompactMel written out, PCM samples as float32)."""
        if isinstance(x, PcmWindow):
            return stage_pcm(x, self.stager if device.type == "cuda" else None)
        return self.stager.stage(x, device)

    def to_device(self, inputs: list[Any], device: torch.device) -> torch.Tensor:
        """``[N, n_mels, frames]`` float32 (or the log-mels' dtype) on ``device``, in order."""
        pcm = [i for i, x in enumerate(inputs) if isinstance(x, PcmWindow)]
        if not pcm:
            for m in inputs:
                self.check_mel(m)
            return mels_to_device(inputs, device, self.stager.is_staged)
        computed = window_log_mels([inputs[i] for i in pcm], self.filters(device),
                                   self.stager.is_staged)
        if len(pcm) == len(inputs):
            return computed  # [N, n_mels, frames]
        taken = set(pcm)
        rest = [i for i in range(len(inputs)) if i not in taken]
        mels = self.to_device([inputs[i] for i in rest], device)
        rows: list[torch.Tensor] = [None] * len(inputs)  # type: ignore[list-item]
        for i, row in zip(pcm, computed, strict=True):
            rows[i] = row
        for i, row in zip(rest, mels, strict=True):
            rows[i] = row.to(computed.dtype)
        return torch.stack(rows)

    def filters(self, device: torch.device) -> torch.Tensor:
        """The mel filterbank ``[n_mels, 201]`` on ``device``, made once (an upload from
        pageable memory waits for the device: not in a step's path after the first)."""
        f = self._filters.get(device)
        if f is None:
            f = self._filters[device] = mel_filters(self.n_mels, device)
        return f
