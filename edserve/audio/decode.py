"""Decode any audio container into float32 mono samples with PyAV (FFmpeg).

``load_audio`` accepts a path, raw bytes, or a binary file object, decodes the first audio
stream whatever its codec, sample rate or channel layout (wav, flac, mp3, ogg/opus/vorbis,
m4a/aac, ...), and resamples it with FFmpeg's resampler to mono float32 at ``sample_rate``.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import av
import numpy as np

from edserve.audio.errors import AudioDecodeError, EmptyAudioError

AudioSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO


def _describe(source: AudioSource) -> str:
    """A human-readable name for ``source`` to put in error messages."""
    if isinstance(source, str | os.PathLike):
        return repr(os.fspath(source))
    if isinstance(source, bytes | bytearray | memoryview):
        return f"<{len(source)} bytes of audio>"
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(source).__name__} stream>"


def _is_zero_length(source: AudioSource) -> bool:
    if isinstance(source, bytes | bytearray | memoryview):
        return len(source) == 0
    if isinstance(source, str | os.PathLike):
        return os.path.isfile(source) and os.path.getsize(source) == 0
    return False


def _decode(container: av.container.InputContainer, sample_rate: int) -> list[np.ndarray]:
    """Decode + resample the first audio stream; returns float32 chunks, each ``[n]``."""
    if not container.streams.audio:
        raise AudioDecodeError("no audio stream")
    stream = container.streams.audio[0]
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    chunks: list[np.ndarray] = []
    for frame in container.decode(stream):
        frame.pts = None  # let the resampler follow samples, not possibly broken timestamps
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray().reshape(-1))  # packed flt mono: [1, n] -> [n]
    for out in resampler.resample(None):  # flush the resampler's delay line
        chunks.append(out.to_ndarray().reshape(-1))
    return chunks


def load_audio(source: AudioSource, sample_rate: int = 16000) -> np.ndarray:
    """Decode ``source`` to float32 mono samples in [-1, 1] at ``sample_rate`` Hz.

    ``source``: a file path, the file's bytes, or a readable binary file object.
    Returns ``[num_samples]`` float32.
    Raises :class:`AudioDecodeError` when the input is unreadable, corrupt or holds no audio
    stream, and :class:`EmptyAudioError` when it holds no samples; messages name the input.
    """
    name = _describe(source)
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if _is_zero_length(source):
        raise EmptyAudioError(f"audio input {name} is empty (0 bytes)")
    if isinstance(source, bytes | bytearray | memoryview):
        source = io.BytesIO(source)
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    try:
        with av.open(source, mode="r", metadata_errors="ignore") as container:
            chunks = _decode(container, sample_rate)
    except AudioDecodeError as e:
        raise AudioDecodeError(f"cannot decode audio {name}: {e}") from None
    except FileNotFoundError as e:
        raise AudioDecodeError(f"cannot decode audio {name}: file not found") from e
    except (av.FFmpegError, OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise AudioDecodeError(f"cannot decode audio {name}: {reason}") from e
    if not chunks:
        raise EmptyAudioError(f"audio input {name} holds no samples")
    audio = np.concatenate(chunks)  # [num_samples]
    if audio.size == 0:
        raise EmptyAudioError(f"audio input {name} holds no samples")
    return np.clip(audio, -1.0, 1.0, out=audio)
