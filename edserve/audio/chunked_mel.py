"""Whisper's long-form log-mel in chunks of frames: the same numbers as
:func:`~edserve.audio.mel.log_mel_spectrogram` with ``padding`` (equal bits on the CPU,
tested), in bounded memory and, on the CPU, ~3x faster on long audio.

Frame ``i`` of ``torch.stft(center=True)`` is the FFT of samples
``[i * HOP - N_FFT / 2, i * HOP + N_FFT / 2)`` of the reflect-padded signal, so each chunk is
an uncentred STFT over its slice of that padded signal: the same frames, each a separate FFT.
A chunk's intermediates (the framed signal, the spectrum, its power) stay in cache on the CPU
(:data:`HOST_CHUNK_FRAMES`: 10 s of audio) and bound the device memory a request takes on a
GPU (:data:`DEVICE_CHUNK_FRAMES`: ~11 minutes, ~300 MB, where one STFT over an hour of audio
would hold ~2 GB). The log and the floor (global max - 8) run in place once every chunk is in.
Frames that see only the appended zeros are not computed: they all hold one value (``fill``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edserve.audio.mel import (
    FRAME_QUANTUM,
    HOP_LENGTH,
    N_FFT,
    N_SAMPLES,
    computed_zeros,
    mel_filters,
    silence_value,
)

HOST_CHUNK_FRAMES = 1024
DEVICE_CHUNK_FRAMES = 1 << 16


def chunked_log_mel(audio: torch.Tensor, n_mels: int, padding: int = N_SAMPLES,
                    chunk_frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``audio`` ``[num_samples]`` float32 (on any device) followed by ``padding`` zeros ->
    ``(head, fill, frames)``: the log-mel is ``[n_mels, frames]``, its columns
    ``0 .. head.shape[1]`` are ``head`` (on ``audio``'s device) and every later entry is
    ``fill`` (a 0-d tensor: the value of a frame that sees only zeros)."""
    if audio.dim() != 1:
        raise ValueError(f"audio must be 1-D [num_samples], got shape {tuple(audio.shape)}")
    if chunk_frames is None:
        chunk_frames = HOST_CHUNK_FRAMES if audio.device.type == "cpu" else DEVICE_CHUNK_FRAMES
    if chunk_frames < 1 or chunk_frames % FRAME_QUANTUM:
        raise ValueError(f"chunk_frames must be a positive multiple of {FRAME_QUANTUM}")
    frames = (audio.shape[0] + padding) // HOP_LENGTH
    # as log_mel_spectrogram: frames wholly in the appended zeros are not computed
    signal = F.pad(audio.float(), (0, computed_zeros(audio.shape[0], padding)))
    kept = min(signal.shape[0] // HOP_LENGTH, frames)
    half = N_FFT // 2
    padded = F.pad(signal[None, None], (half, half), mode="reflect")[0, 0]
    window = torch.hann_window(N_FFT, device=audio.device)
    filters = mel_filters(n_mels, audio.device)  # [n_mels, 201]
    log_spec = torch.empty(n_mels, kept, dtype=torch.float32, device=audio.device)
    for a in range(0, kept, chunk_frames):
        b = min(kept, a + chunk_frames)
        piece = padded[a * HOP_LENGTH:(b - 1) * HOP_LENGTH + N_FFT]
        stft = torch.stft(piece, N_FFT, HOP_LENGTH, window=window, center=False,
                          return_complex=True)  # [201, b - a]
        power = stft.abs() ** 2
        torch.matmul(filters, power, out=log_spec[:, a:b])
    log_spec.clamp_(min=1e-10).log10_()  # [n_mels, kept]
    floor = log_spec.max() - 8.0
    torch.maximum(log_spec, floor, out=log_spec).add_(4.0).div_(4.0)
    return log_spec, silence_value(floor, n_mels)[0, 0], frames
