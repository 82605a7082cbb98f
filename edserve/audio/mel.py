"""Whisper's log-mel spectrogram, numerically identical to openai-whisper's ``audio.py``.

Constants are Whisper's: 16 kHz audio, 25 ms windows (``N_FFT`` 400) every 10 ms
(``HOP_LENGTH`` 160), and 30 s windows (``N_SAMPLES`` samples -> ``N_FRAMES`` frames).
The mel filterbank is librosa's Slaney filterbank (``htk=False, norm="slaney"``), the same
numbers openai-whisper ships in ``mel_filters.npz``; it is computed here, not downloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from edserve.audio.compact_mel import CompactMel
from edserve.audio.frames import (  # noqa: F401 (re-exported: the audio stack's constants)
    CHUNK_LENGTH,
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
)
from edserve.audio.held_mel import HeldMel, MelWindowRef
from edserve.audio.pcm_window import PcmMel, PcmWindow
from edserve.config import MEL_PADDINGS

# Appended zeros after which a frame's window (N_FFT samples around its centre, reflected at the
# signal's end) holds only zeros: the last computed frame ends >= N_FFT // 2 + 1 zeros before
# the end, and every frame after it starts past the audio.
ZERO_TAIL = 2 * N_FFT
FRAME_QUANTUM = 64

# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    mel = hz / _F_SP
    log_region = hz >= _MIN_LOG_HZ
    mel[log_region] = _MIN_LOG_MEL + np.log(hz[log_region] / _MIN_LOG_HZ) / _LOG_STEP
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = _F_SP * mel
    log_region = mel >= _MIN_LOG_MEL
    hz[log_region] = _MIN_LOG_HZ * np.exp(_LOG_STEP * (mel[log_region] - _MIN_LOG_MEL))
    return hz


@functools.lru_cache(maxsize=8)
def _slaney_filterbank(n_mels: int) -> np.ndarray:
    """``librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)``: ``[n_mels, 201]`` float32."""
    fft_freqs = np.fft.rfftfreq(N_FFT, d=1.0 / SAMPLE_RATE)  # [n_freqs] bin centres, Hz
    edges = np.array([0.0, SAMPLE_RATE / 2.0])
    mel_lo, mel_hi = _hz_to_mel(edges)
    mel_f = _mel_to_hz(np.linspace(mel_lo, mel_hi, n_mels + 2))  # [n_mels + 2] band edges, Hz
    fdiff = np.diff(mel_f)  # [n_mels + 1]
    ramps = mel_f[:, None] - fft_freqs[None, :]  # [n_mels + 2, n_freqs]
    lower = -ramps[:-2] / fdiff[:-1, None]  # rising slopes   [n_mels, n_freqs]
    upper = ramps[2:] / fdiff[1:, None]  # falling slopes  [n_mels, n_freqs]
    # float32 before the norm, then the norm in float64 rounded once more: librosa's order of
    # roundings, so the numbers equal openai-whisper's mel_filters.npz bit for bit
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]  # Slaney norm: constant energy per band
    weights.flags.writeable = False
    return weights


def mel_filters(n_mels: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Whisper's mel filterbank ``[n_mels, N_FFT // 2 + 1]`` float32 (n_mels is 80 or 128)."""
    if n_mels <= 0:
        raise ValueError(f"n_mels must be positive, got {n_mels}")
    return torch.tensor(_slaney_filterbank(n_mels), device=device)


def pad_or_trim(array: np.ndarray | torch.Tensor, length: int = N_SAMPLES, *, axis: int = -1):
    """Zero-pad or cut ``array`` along ``axis`` to exactly ``length`` (same type as the input)."""
    size = array.shape[axis]
    if torch.is_tensor(array):
        axis = axis % array.dim()
        if size > length:
            return array.narrow(axis, 0, length)
        if size < length:
            pad = [0, 0] * (array.dim() - 1 - axis) + [0, length - size]  # last dim first
            return F.pad(array, pad)
        return array
    if size > length:
        index = [slice(None)] * array.ndim
        index[axis] = slice(0, length)
        return array[tuple(index)]
    if size < length:
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, length - size)
        return np.pad(array, widths)
    return array


def computed_zeros(num_samples: int, padding: int) -> int:
    """Of ``padding`` zeros appended to ``num_samples`` samples, how many the STFT must see:
    frames whose window lies wholly in the zeros have power exactly 0 and are not computed.
    The computed frames are a multiple of FRAME_QUANTUM, at least 2 * FRAME_QUANTUM, so the
    FFT's and the filterbank product's vector blocks do not change (bit-identical to the STFT
    over all of it, tested)."""
    keep = -(-((num_samples + ZERO_TAIL) // HOP_LENGTH + 1) // FRAME_QUANTUM) * FRAME_QUANTUM
    return min(padding, max(2 * FRAME_QUANTUM, keep) * HOP_LENGTH - num_samples)


def silence_value(floor: torch.Tensor, n_mels: int) -> torch.Tensor:
    """``[n_mels, 1]``: the scaled log-mel of a frame of power 0 under ``floor`` (max - 8),
    made by the same (vectorized) ops as the computed frames'."""
    zeros = torch.zeros(n_mels, FRAME_QUANTUM, dtype=floor.dtype, device=floor.device)
    return ((torch.maximum(torch.clamp(zeros, min=1e-10).log10(), floor) + 4.0) / 4.0)[:, :1]


def log_mel_spectrogram(
    audio: np.ndarray | torch.Tensor,
    n_mels: int = 80,
    padding: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """openai-whisper's ``log_mel_spectrogram``: ``[num_samples]`` 16 kHz -> ``[n_mels, frames]``.

    ``padding`` zeros are appended before the STFT; frames = (num_samples + padding) // 160.
    Values are log10 power, floored at (max - 8), then mapped by (x + 4) / 4.
    """
    if not torch.is_tensor(audio):
        audio = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    if audio.dim() != 1:
        raise ValueError(f"audio must be 1-D [num_samples], got shape {tuple(audio.shape)}")
    if device is not None:
        audio = audio.to(device)
    audio = audio.float()
    frames = (audio.shape[0] + padding) // HOP_LENGTH
    # Frames whose window lies wholly in the appended zeros have power exactly 0: the STFT runs
    # over the audio + at least ZERO_TAIL zeros only (the frames it gives see the same samples
    # as with all the padding, end reflection included), the other frames stay 0 (30 s of
    # padding: 73 % of an 11 s clip's frames); see computed_zeros.
    audio = F.pad(audio, (0, computed_zeros(audio.shape[0], padding)))
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # [201, T'+1]
    magnitudes = stft[..., :-1].abs() ** 2  # [201, T']
    mel_spec = mel_filters(n_mels, audio.device) @ magnitudes  # [n_mels, T']
    kept = min(mel_spec.shape[1], frames)
    log_spec = torch.clamp(mel_spec[:, :kept], min=1e-10).log10()  # [n_mels, kept]
    floor = log_spec.max() - 8.0  # the zero frames' log (-10) is below every computed one
    out = torch.empty(n_mels, frames, dtype=log_spec.dtype, device=log_spec.device)
    torch.div(torch.maximum(log_spec, floor) + 4.0, 4.0, out=out[:, :kept])
    if kept < frames:  # power 0: one value, made by the same ops as the computed frames'
        out[:, kept:] = silence_value(floor, n_mels)  # [n_mels, 1] broadcast
    return out  # [n_mels, T]


def whisper_features(
    audio: np.ndarray | torch.Tensor, n_mels: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Encoder input for one 30 s window: ``[num_samples]`` -> ``[n_mels, N_FRAMES]``.

    The audio is zero-padded (or cut) to ``N_SAMPLES`` *before* the STFT (as HF's feature
    extractor does: the ``silence`` layout of :func:`window_features`), then the log-mel is
    cut to ``N_FRAMES`` frames.
    """
    audio = pad_or_trim(audio, N_SAMPLES)
    return log_mel_spectrogram(audio, n_mels, device=device)[:, :N_FRAMES]


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``; a float32 CPU tensor is copied by numpy on the calling thread
    (a request's window is cut on the API's event loop, where torch's copy would wake its
    intra-op thread team: 0.49 ms of process CPU per [80, 3000] window with 2 threads vs
    0.07 ms, measured)."""
    if t.is_contiguous() or t.device.type != "cpu" or t.dtype != torch.float32 \
            or t.requires_grad:
        return t.contiguous()
    return torch.from_numpy(np.ascontiguousarray(t.numpy()))


# A window layout: (log-mel of the whole audio + N_SAMPLES zeros [n_mels, content + N_FRAMES]:
# a tensor, a CompactMel or a HeldMel, sliced as mel[:, a:b], first frame, real frames) -> the
# encoder input [n_mels, N_FRAMES] (a HeldMel's: a MelWindowRef, written out by its worker).
Mel = torch.Tensor | CompactMel | HeldMel | PcmMel
Window = torch.Tensor | CompactMel | MelWindowRef | PcmWindow
WindowLayout = Callable[[Mel, int, int], Window]


def _silence_window(mel: Mel, seek: int, size: int) -> Window:
    # frames past the audio: the appended silence's; a CompactMel's window stays compact
    if isinstance(mel, PcmMel):  # computed in the prefill step (edserve.audio.pcm_window)
        return mel.window(seek, size, zero_filled=False)
    if isinstance(mel, (CompactMel, HeldMel)):
        return mel.window(seek, seek + N_FRAMES)
    return mel[:, seek:seek + N_FRAMES]


def _zero_filled_window(mel: Mel, seek: int, size: int) -> Window:
    if isinstance(mel, PcmMel):
        return mel.window(seek, size, zero_filled=True)
    if isinstance(mel, HeldMel):  # the same zeros, written by the worker holding it
        return mel.window(seek, seek + size, N_FRAMES)
    return pad_or_trim(mel[:, seek:seek + size], N_FRAMES)  # frames past the audio: 0.0


WINDOW_LAYOUTS: dict[str, WindowLayout] = {"silence": _silence_window,
                                           "zeros": _zero_filled_window}
assert tuple(WINDOW_LAYOUTS) == MEL_PADDINGS


def window_features(mel: Mel, seek: int, size: int, padding: str) -> Window:
    """The encoder input ``[n_mels, N_FRAMES]`` of the window whose audio is frames
    ``seek .. seek + size`` (``size`` <= ``N_FRAMES``) of ``mel``.

    ``mel`` is the log-mel of the *whole* audio followed by ``N_SAMPLES`` zero samples
    (``log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES)``: one STFT, one max-8 floor for
    the whole audio, as openai-whisper's ``transcribe``), as a tensor, as a
    :class:`~edserve.audio.compact_mel.CompactMel` (whose windows come out contiguous; the
    ``silence`` window of one is a CompactMel itself, which the model writes out when the
    request is staged: see :mod:`edserve.models.mel_staging`) or as a
    :class:`~edserve.audio.held_mel.HeldMel` kept by an engine worker (its windows are
    :class:`~edserve.audio.held_mel.MelWindowRef`, written out by that worker) or as a
    :class:`~edserve.audio.pcm_window.PcmMel` (a short clip whose windows, a
    :class:`~edserve.audio.pcm_window.PcmWindow`, the engine computes). The layouts
    differ only in a window shorter than 30 s (``size < N_FRAMES``: a clip under 30 s, the
    last window of long audio):

    * ``silence``: the next ``N_FRAMES - size`` frames of ``mel``, i.e. the log-mel of the
      appended silence (HF's feature extractor; ``log_mel_spectrogram(pad_or_trim(audio))``
      for a clip under 30 s, the input of openai-whisper's README ``decode()`` example and of
      its ``detect_language`` inside ``transcribe``);
    * ``zeros``: those frames are 0.0 (openai-whisper's ``transcribe`` decoding and
      faster-whisper: ``pad_or_trim(mel[:, seek:seek + size], N_FRAMES)``).

    Returns a contiguous tensor (:func:`host_contiguous`), a CompactMel, a MelWindowRef or a
    PcmWindow.
    ``padding`` is a name of :data:`WINDOW_LAYOUTS` (validated where options are built:
    :func:`edserve.config.check_mel_padding`).
    """
    if not 0 < size <= N_FRAMES or seek + N_FRAMES > mel.shape[-1]:
        raise ValueError(f"window of {size} frames at {seek} does not fit a log-mel of "
                         f"{mel.shape[-1]} frames (content + {N_FRAMES} frames of silence)")
    window = WINDOW_LAYOUTS[padding](mel, seek, size)
    return window if isinstance(window, (CompactMel, MelWindowRef, PcmWindow)) \
        else host_contiguous(window)
