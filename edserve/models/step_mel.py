"""The log-mels of a prefill step's short clips, computed together on the model's device.

A :class:`~edserve.audio.pcm_window.PcmWindow` carries a clip's samples (at most
:data:`~edserve.audio.pcm_window.MAX_STEP_SAMPLES`) instead of its log-mel. The step puts every
such clip into one zero-padded ``[N, N_SAMPLES]`` signal and runs the long-form log-mel's ops
on all rows at once (:func:`window_log_mels`): the reflect padding, one batched STFT, the
filterbank product, ``log10``, each row's floor (its maximum - 8) and the ``(x + 4) / 4``
scale, in the order :func:`~edserve.audio.chunked_mel.chunked_log_mel` runs them, so the
values equal the host's long-form log-mel within float32 rounding (tested). No host<->device
sync: the samples come from page-locked memory (:func:`stage_pcm`), the windows' offsets too.
16-bit uploads stay int16 until the device (half the bytes staged and copied, no host pass
over them): there ``x * 2**-15``, exact in float32, so the features equal a host conversion's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from edserve.audio.frames import HOP_LENGTH, N_FFT, N_FRAMES, N_SAMPLES
from edserve.audio.pcm_window import PcmWindow
from edserve.audio.wav_pcm import PCM16_SCALE, pcm16_to_float
from edserve.models.mel_staging import MelStager


def float_samples(samples: np.ndarray) -> torch.Tensor:
    """``[num_samples]`` host samples as a float32 CPU tensor (int16 scaled by 2**-15,
    exact)."""
    if samples.dtype == np.int16:
        return torch.from_numpy(pcm16_to_float(samples))
    return torch.from_numpy(samples)


def stage_pcm(window: PcmWindow, stager: MelStager | None) -> PcmWindow:
    """``window`` with its samples as a CPU tensor: page-locked, in their own dtype (int16 or
    float32), when a ``stager`` (a CUDA model's) has room for them (the step then uploads them
    by one non-blocking copy); otherwise float32 (the step stages them itself)."""
    if torch.is_tensor(window.samples):
        return window
    samples = window.samples
    dtype = torch.int16 if samples.dtype == np.int16 else torch.float32
    out = stager.pinned_empty((len(samples),), dtype) if stager is not None else None
    if out is None:
        return dataclasses.replace(window, samples=float_samples(samples))
    out.numpy()[...] = samples  # one memcpy (a float64 array: converted)
    return dataclasses.replace(window, samples=out)


def _upload(windows: list[PcmWindow], device: torch.device,
            staged: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    """``[N, N_SAMPLES]`` float32 on ``device``: each clip's samples, then zeros (int16
    tensors are copied as they are and scaled there)."""
    signal = torch.zeros(len(windows), N_SAMPLES, dtype=torch.float32, device=device)
    pcm16 = None  # [N, N_SAMPLES] int16 on device: the int16 rows (others stay 0)
    for i, w in enumerate(windows):
        samples = w.samples if torch.is_tensor(w.samples) else float_samples(w.samples)
        if device.type == "cuda" and not staged(samples):
            samples = samples.pin_memory()
        if samples.dtype == torch.int16:
            if pcm16 is None:
                pcm16 = torch.zeros(len(windows), N_SAMPLES, dtype=torch.int16, device=device)
            pcm16[i, :len(samples)].copy_(samples, non_blocking=True)
        else:
            signal[i, :len(samples)].copy_(samples, non_blocking=True)
    if pcm16 is not None:  # a row is int16 or float32, the other buffer's row 0: exact sum
        signal.add_(pcm16, alpha=float(PCM16_SCALE))
    return signal


def _offsets(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)  # [N]
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def window_log_mels(windows: list[PcmWindow], filters: torch.Tensor,
                    staged: Callable[[torch.Tensor], bool] = lambda t: False) -> torch.Tensor:
    """The encoder inputs ``[N, n_mels, N_FRAMES]`` float32 of ``windows`` on the device of
    ``filters`` (:func:`~edserve.audio.mel.mel_filters` ``[n_mels, 201]``, made once by the
    caller: making it uploads from pageable memory, a sync) (each: columns ``seek ..`` of its
    clip's long-form log-mel, columns from ``zeros_from`` on 0.0). ``staged(samples)``: they
    are page-locked already (:func:`stage_pcm`; asking the driver costs ~0.1 ms a tensor)."""
    n, n_mels, device = len(windows), filters.shape[0], filters.device
    signal = _upload(windows, device, staged)  # [N, N_SAMPLES]
    half = N_FFT // 2
    padded = F.pad(signal[:, None], (half, half), mode="reflect")[:, 0]  # [N, N_SAMPLES + N_FFT]
    window = torch.hann_window(N_FFT, device=device)
    stft = torch.stft(padded, N_FFT, HOP_LENGTH, window=window, center=False,
                      return_complex=True)  # [N, 201, N_FRAMES + 1]
    power = stft[..., :N_FRAMES].abs() ** 2  # [N, 201, N_FRAMES]
    log_spec = torch.matmul(filters, power)  # [N, n_mels, N_FRAMES]
    log_spec.clamp_(min=1e-10).log10_()
    floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0  # [N, 1, 1]
    torch.maximum(log_spec, floor, out=log_spec).add_(4.0).div_(4.0)
    out = log_spec
    if any(w.seek for w in windows):  # a later window: shifted left, then the silence's value
        zeros = torch.zeros(n, 1, 1, dtype=floor.dtype, device=device)
        silence = (torch.maximum(torch.clamp(zeros, min=1e-10).log10(), floor) + 4.0) / 4.0
        cols = torch.arange(N_FRAMES, device=device) + _offsets(
            [w.seek for w in windows], device)[:, None]  # [N, N_FRAMES] source columns
        index = cols.clamp(max=N_FRAMES - 1)[:, None].expand(n, n_mels, N_FRAMES)
        out = torch.where((cols < N_FRAMES)[:, None], out.gather(2, index), silence)
    if any(w.zeros_from < N_FRAMES for w in windows):  # the zeros layout
        limit = _offsets([w.zeros_from for w in windows], device)[:, None, None]  # [N, 1, 1]
        out = out.masked_fill(torch.arange(N_FRAMES, device=device) >= limit, 0.0)
    return out
