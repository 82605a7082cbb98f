"""A short clip whose log-mel the engine computes inside its prefill step (``--step-features``).

An 11 s clip's log-mel costs ~7 ms of an audio worker's CPU and leaves it as ~0.6 MB that
the API process receives, sends on to the engine process, and the engine writes out into a
1.5 MB page-locked window before uploading it. The samples themselves are 0.35 MB (16-bit),
and on a GPU the log-mels of every clip a prefill step admits are one batched STFT and one
filterbank product (:func:`edserve.models.step_mel.window_log_mels`), a few launches for the
whole step.

:class:`PcmMel` stands in for a clip's long-form log-mel (the audio followed by 30 s of
zeros, :func:`~edserve.audio.mel.window_features`' ``mel``) where the clip fits one window:
slicing it gives a :class:`PcmWindow`, the request's ``encoder_input``, which carries the
samples and where the window starts. The numbers are the long-form log-mel's (within float32
rounding: a device FFT is not the host's), because for a clip of at most
:data:`MAX_STEP_SAMPLES` samples every frame from :data:`~edserve.audio.mel.N_FRAMES` on sees
only zeros: the first 3000 frames of the clip padded to 30 s hold the whole audio's maximum
(the floor ``max - 8``), and any later frame is the silence's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edserve.audio.frames import HOP_LENGTH, N_FFT, N_FRAMES, N_SAMPLES

#: Longest clip (16 kHz samples) a :class:`PcmMel` takes: frame ``N_FRAMES`` (centred on sample
#: ``N_SAMPLES``, ``N_FFT // 2`` each side) and every later one then see only zeros.
MAX_STEP_SAMPLES = N_SAMPLES - N_FFT // 2


def fits_step(num_samples: int) -> bool:
    """Whether a clip of ``num_samples`` can have its log-mel computed in the prefill step."""
    return 0 < num_samples <= MAX_STEP_SAMPLES


def _check_samples(samples: np.ndarray) -> None:
    if not isinstance(samples, np.ndarray) or samples.ndim != 1 \
            or samples.dtype not in (np.int16, np.float32):
        got = f"{samples.dtype} {samples.shape}" if isinstance(samples, np.ndarray) \
            else type(samples).__name__
        raise ValueError(f"PCM samples must be a 1-D int16 or float32 array, got {got}")
    if not fits_step(len(samples)):
        raise ValueError(f"a clip of {len(samples)} samples does not fit one step's log-mel "
                         f"(1..{MAX_STEP_SAMPLES})")


@dataclass(frozen=True, eq=False)
class PcmWindow:
    """The encoder input ``[n_mels, N_FRAMES]``: columns ``seek ..`` of the long-form log-mel
    of ``samples`` (``[num_samples]`` 16 kHz, int16 as a 16-bit WAV holds them or float32),
    columns from ``zeros_from`` on set to 0.0 (the ``zeros`` layout; ``N_FRAMES``: none).

    ``samples`` becomes a page-locked float32 tensor when the request is staged
    (:meth:`edserve.models.whisper.WhisperForConditionalGeneration.stage_encoder_input`)."""

    samples: np.ndarray | object  # np.ndarray [num_samples], or a staged torch.Tensor
    n_mels: int
    seek: int = 0
    zeros_from: int = N_FRAMES

    def __post_init__(self) -> None:
        if isinstance(self.samples, np.ndarray):
            _check_samples(self.samples)
        if not 0 <= self.seek < N_FRAMES or not 0 < self.zeros_from <= N_FRAMES:
            raise ValueError(f"bad PCM window: seek {self.seek}, zeros from {self.zeros_from}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_mels, N_FRAMES)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def num_samples(self) -> int:
        return len(self.samples)


@dataclass(frozen=True, eq=False)
class PcmMel:
    """A short clip's long-form log-mel ``[n_mels, num_samples // HOP_LENGTH + N_FRAMES]``
    before it is computed. ``.shape`` as the log-mel's; :meth:`window` gives the
    :class:`PcmWindow` of a window (what :func:`~edserve.audio.mel.window_features` returns
    for it). ``samples``: int16 or float32 (finite: checked where the audio was decoded)."""

    samples: np.ndarray
    n_mels: int

    def __post_init__(self) -> None:
        _check_samples(self.samples)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_mels, len(self.samples) // HOP_LENGTH + N_FRAMES)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def window(self, seek: int, size: int, zero_filled: bool) -> PcmWindow:
        """The window whose audio is frames ``seek .. seek + size``; ``zero_filled``: the
        frames after them are 0.0 (else the appended silence's)."""
        content = len(self.samples) // HOP_LENGTH
        if not 0 <= seek < N_FRAMES or not 0 < size <= content - seek:
            raise ValueError(f"window of {size} frames at {seek} of a {content}-frame clip")
        return PcmWindow(self.samples, self.n_mels, seek, size if zero_filled else N_FRAMES)
