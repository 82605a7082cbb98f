"""The common upload read without FFmpeg: 16-bit PCM mono WAV already at the model's rate.

Speech clips sent to a transcription API are most often exactly this (16 kHz mono s16le
WAV), and for them FFmpeg's probe, decoder and resampler cost ~14 ms per 11 s clip for what is
one integer-to-float conversion. :func:`read_pcm_wav` parses such a file with the standard
library's :mod:`wave` and converts it as FFmpeg's ``s16 -> flt`` does (``x * 2**-15``: exact,
so the samples equal :func:`~edserve.audio.decode.load_audio`'s FFmpeg path bit for bit,
tested). Anything else (other rates, channels, widths, compressed or extensible formats,
truncated or malformed headers, a data chunk that declares more bytes than it holds, an
empty file, a length near the caller's limit) returns ``None`` and goes down the FFmpeg path,
which gives every refusal its usual message.
"""

from __future__ import annotations

import io
import math
import wave
from typing import BinaryIO

import numpy as np

from edserve.audio.errors import AudioTooLongError

#: int16 -> float32 sample scale; a power of two, so ``x * PCM16_SCALE`` is exact in float32 on
#: any device (the engine's log-mel converts int16 uploads with it too).
PCM16_SCALE = np.float32(1.0 / 32768.0)


def pcm16_to_float(pcm: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """int16 samples -> float32 in [-1, 1) (``x / 32768``: exact in float32), into ``out``
    when given (e.g. page-locked memory)."""
    return np.multiply(pcm, PCM16_SCALE, out=out, dtype=np.float32)


def read_pcm_wav(file: BinaryIO, sample_rate: int, max_seconds: float | None,
                 slack: float, pcm16: bool = False) -> np.ndarray | None:
    """``[num_samples]`` float32 in [-1, 1) (``pcm16``: the int16 samples as stored) when
    ``file`` (seekable, at the audio's start) is a 16-bit PCM mono WAV at ``sample_rate`` Hz
    whose data chunk is complete; else ``None`` (nothing raised; the samples are read only
    once the header matches).

    Raises :class:`AudioTooLongError` (``exact=True``) when such a file declares more than
    ``max_seconds + slack`` seconds, as the FFmpeg path does for WAV's exact header duration;
    a file between the limit and the slack returns ``None`` (the FFmpeg path decides).
    """
    head = file.read(12)
    file.seek(-len(head), io.SEEK_CUR)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    try:
        with wave.open(file, "rb") as w:  # a file object passed in is left open
            params = (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getcomptype())
            frames = w.getnframes()
            raw = w.readframes(frames) if params == (1, 2, sample_rate, "NONE") else b""
    except Exception:  # noqa: BLE001 - the stdlib parser on untrusted bytes: FFmpeg decides
        return None
    if not raw or len(raw) != 2 * frames:  # truncated data chunk: FFmpeg decodes what is there
        return None
    seconds = frames / sample_rate
    if max_seconds is not None:
        if seconds > max_seconds + slack:
            raise AudioTooLongError(seconds, max_seconds, exact=True)
        if frames > math.floor(max_seconds * sample_rate):
            return None
    pcm = np.frombuffer(raw, dtype="<i2")  # [frames]
    return pcm.astype(np.int16) if pcm16 else pcm16_to_float(pcm)
