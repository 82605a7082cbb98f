"""Decode an audio container into float32 mono samples with PyAV (FFmpeg), safely and bounded.

``load_audio`` accepts a path, raw bytes, or a binary file object, decodes the first audio
stream whatever its codec, sample rate or channel layout (wav, flac, mp3, ogg/opus/vorbis,
m4a/aac, ...), and resamples it with FFmpeg's resampler to mono float32 at ``sample_rate``.

Safety (the server feeds it untrusted uploads):

* Only the containers in :data:`edserve.audio.formats.ALLOWED_DEMUXERS` are opened, and FFmpeg
  can never open a second file or URL (no ``concat`` scripts, HLS playlists, image sequences):
  see :mod:`edserve.audio.formats`. This holds for trusted callers (the CLI) too.
* ``max_seconds`` bounds the work: a container that declares a longer duration is refused
  before any packet is decoded, and decoding stops as soon as the decoded samples exceed the
  limit (a file that declares nothing, or lies, costs at most ``max_seconds`` of samples).
* ``cancel`` (a ``threading.Event``) is checked between frames.
* NaN / infinite samples (float PCM can carry them) are refused chunk by chunk.
* ``untrusted=True`` makes every refusal of the bytes one fixed message
  (:data:`UNTRUSTED_DECODE_MESSAGE`): no paths, no FFmpeg text, nothing that tells a prober
  which files exist or which parser ran.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO

import av
import numpy as np

from edserve.audio.errors import (
    AudioDecodeError,
    AudioTooLongError,
    DecodeCancelled,
    EmptyAudioError,
    NonFiniteAudioError,
)
from edserve.audio.formats import UnsupportedFormatError, declared_seconds, open_container
from edserve.audio.wav_pcm import read_pcm_wav

AudioSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO

#: The one message of every :class:`AudioDecodeError` raised for an untrusted input.
UNTRUSTED_DECODE_MESSAGE = (
    "could not decode the upload as audio (unsupported, corrupt or not an audio file)"
)
#: The message of :class:`EmptyAudioError` for an untrusted input.
UNTRUSTED_EMPTY_MESSAGE = "the upload holds no audio samples"
#: A declared duration refuses early only when it exceeds the limit by more than this (s);
#: audio within the slack is decoded and the exact decoded length decides.
DECLARED_DURATION_SLACK = 1.0

# What PyAV / FFmpeg / file I/O raise for bytes they cannot use.
_DECODE_FAILURES = (av.FFmpegError, OSError, ValueError, EOFError, RuntimeError, IndexError)


def _describe(source: AudioSource) -> str:
    """A human-readable name for ``source`` to put in (trusted) error messages."""
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


@contextlib.contextmanager
def _as_file(source: AudioSource) -> Iterator[BinaryIO]:
    """``source`` as a readable binary file object (paths opened here, by Python, not FFmpeg).

    A caller's file object is left open; files opened here are closed.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        yield io.BytesIO(source)
    elif isinstance(source, str | os.PathLike):
        with open(os.fspath(source), "rb") as f:
            yield f
    else:
        yield source


def _pcm_wav_fast_path(source: AudioSource, sample_rate: int,
                       max_seconds: float | None) -> np.ndarray | None:
    """16-bit PCM mono WAV at ``sample_rate`` given as bytes or a path: read without FFmpeg
    (:mod:`edserve.audio.wav_pcm`, the same samples); None for everything else (a path's file
    is then read no further than its header)."""
    if isinstance(source, bytes | bytearray | memoryview):
        return read_pcm_wav(io.BytesIO(source), sample_rate, max_seconds,
                            DECLARED_DURATION_SLACK)
    if not isinstance(source, str | os.PathLike):
        return None
    try:
        with open(os.fspath(source), "rb") as f:
            return read_pcm_wav(f, sample_rate, max_seconds, DECLARED_DURATION_SLACK)
    except OSError:
        return None  # the FFmpeg path reports it


def _reason(exc: BaseException) -> str:
    """Why decoding failed, for a trusted caller's message."""
    if isinstance(exc, FileNotFoundError):
        return "file not found"
    return getattr(exc, "strerror", None) or str(exc)


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise DecodeCancelled("audio decoding was cancelled")


class _Collector:
    """Collects resampled chunks; refuses non-finite samples and stops past the sample cap."""

    def __init__(self, sample_rate: int, max_seconds: float | None) -> None:
        self.sample_rate = sample_rate
        self.max_seconds = max_seconds
        self.cap = math.inf if max_seconds is None else max_seconds * sample_rate
        self.chunks: list[np.ndarray] = []
        self.total = 0

    def add(self, frames: list[av.AudioFrame]) -> None:
        for out in frames:
            chunk = out.to_ndarray().reshape(-1)  # packed flt mono: [1, n] -> [n]
            if not np.isfinite(chunk).all():
                raise NonFiniteAudioError()
            self.chunks.append(chunk)
            self.total += chunk.size
            if self.total > self.cap:
                raise AudioTooLongError(
                    self.total / self.sample_rate, self.max_seconds, exact=False)


def _decode(
    container: av.container.InputContainer,
    sample_rate: int,
    max_seconds: float | None,
    cancel: threading.Event | None,
) -> list[np.ndarray]:
    """Decode + resample the first audio stream; returns float32 chunks, each ``[n]``.

    Holds at most ``max_seconds * sample_rate`` samples plus one output frame (0.25 s).
    """
    if not container.streams.audio:
        raise AudioDecodeError("no audio stream")
    stream = container.streams.audio[0]
    if max_seconds is not None:
        declared = declared_seconds(container, stream)
        if declared is not None and declared > max_seconds + DECLARED_DURATION_SLACK:
            raise AudioTooLongError(declared, max_seconds, exact=True)
    # output in 0.25 s frames: a numpy conversion per quarter second of audio, not per decoded
    # frame (~1,000 samples in WAV; jfk.wav 19.3 -> 13.3 ms, the same samples)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate,
                                  frame_size=max(1, sample_rate // 4))
    collector = _Collector(sample_rate, max_seconds)
    for frame in container.decode(stream):
        _check_cancel(cancel)
        frame.pts = None  # let the resampler follow samples, not possibly broken timestamps
        collector.add(resampler.resample(frame))
    collector.add(resampler.resample(None))  # flush the resampler's delay line
    return collector.chunks


def load_audio(
    source: AudioSource,
    sample_rate: int = 16000,
    *,
    untrusted: bool = False,
    max_seconds: float | None = None,
    cancel: threading.Event | None = None,
) -> np.ndarray:
    """Decode ``source`` to float32 mono samples in [-1, 1] at ``sample_rate`` Hz.

    ``source``: a file path, the file's bytes, or a readable binary file object (left open).
    ``untrusted``: the input comes from someone else (an upload). Every
    :class:`AudioDecodeError` then carries exactly :data:`UNTRUSTED_DECODE_MESSAGE` and
    :class:`EmptyAudioError` :data:`UNTRUSTED_EMPTY_MESSAGE`: no path, name or FFmpeg text.
    Trusted messages name the input and the reason.
    ``max_seconds``: refuse audio longer than this, without decoding more than this much.
    ``cancel``: when set (checked before opening and between frames), stop.

    Only allow-listed containers are decoded, and nothing but ``source`` is ever read, for
    trusted and untrusted inputs alike (see :mod:`edserve.audio.formats`). A 16-bit PCM mono
    WAV at ``sample_rate`` given as bytes or a path skips FFmpeg (:mod:`edserve.audio.wav_pcm`:
    the same samples, ~14 ms less per 11 s clip).
    Returns ``[num_samples]`` float32.

    Raises (all but the last are :class:`AudioError`, i.e. ``ValueError``):
      :class:`AudioDecodeError`: unreadable, corrupt, not audio, or a container not allowed;
      :class:`EmptyAudioError`: no samples;
      :class:`AudioTooLongError`: longer than ``max_seconds`` (``.seconds``, ``.limit``);
      :class:`NonFiniteAudioError`: a NaN or infinite sample;
      :class:`DecodeCancelled` (plain ``Exception``): ``cancel`` was set.
    ``ValueError`` (not an AudioError) for a bad ``sample_rate`` / ``max_seconds``.
    """
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if max_seconds is not None and not max_seconds > 0:  # also refuses NaN
        raise ValueError(f"max_seconds must be positive, got {max_seconds}")
    name = "the upload" if untrusted else _describe(source)

    def refuse(reason: str) -> AudioDecodeError:
        if untrusted:
            return AudioDecodeError(UNTRUSTED_DECODE_MESSAGE)
        return AudioDecodeError(f"cannot decode audio {name}: {reason}")

    _check_cancel(cancel)
    if _is_zero_length(source):
        raise EmptyAudioError(
            UNTRUSTED_EMPTY_MESSAGE if untrusted else f"audio input {name} is empty (0 bytes)")
    samples = _pcm_wav_fast_path(source, sample_rate, max_seconds)
    if samples is not None:
        return samples
    try:
        with _as_file(source) as file, open_container(file) as container:
            chunks = _decode(container, sample_rate, max_seconds, cancel)
    except (AudioTooLongError, NonFiniteAudioError):
        raise
    except (AudioDecodeError, UnsupportedFormatError, *_DECODE_FAILURES) as e:
        raise refuse(_reason(e)) from (None if untrusted else e)
    if not chunks or sum(c.size for c in chunks) == 0:
        raise EmptyAudioError(
            UNTRUSTED_EMPTY_MESSAGE if untrusted else f"audio input {name} holds no samples")
    audio = np.concatenate(chunks)  # [num_samples]
    return np.clip(audio, -1.0, 1.0, out=audio)
