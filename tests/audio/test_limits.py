"""Bounded decoding: max_seconds (declared and streaming), NaN/inf samples, cancellation."""

from __future__ import annotations

import io
import pickle
import resource
import struct
import threading
import time
import tracemalloc
from pathlib import Path

import av
import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.audio.errors import (
    AudioError,
    AudioTooLongError,
    DecodeCancelled,
    NonFiniteAudioError,
)

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"  # 176000 samples = 11.0 s
MB = 1 << 20


def _silent_flac(seconds: int, rate: int = 16000, block: int = 16384) -> bytes:
    """FLAC of ``seconds`` of digital silence (16384-sample blocks: ~3 KB per minute)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        ctx = stream.codec_context
        ctx.format = "s16"
        ctx.options = {"frame_size": str(block)}
        ctx.open()
        total, pts = seconds * rate, 0
        full = av.AudioFrame.from_ndarray(np.zeros((1, block), np.int16), "s16", "mono")
        while pts < total:
            n = min(block, total - pts)
            frame = full if n == block else av.AudioFrame.from_ndarray(
                np.zeros((1, n), np.int16), "s16", "mono")
            frame.sample_rate, frame.pts = rate, pts
            out.mux(stream.encode(frame))
            pts += n
        out.mux(stream.encode(None))
    return buf.getvalue()


@pytest.fixture(scope="module")
def three_hours_flac() -> bytes:
    data = _silent_flac(3 * 3600)
    assert len(data) < 1 * MB
    return data


def _without_total_samples(flac: bytes) -> bytes:
    """The same FLAC with STREAMINFO's total-samples field zeroed ("unknown")."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # first metadata block: STREAMINFO
    body = 8
    data[body + 13] &= 0xF0  # total samples: low 4 bits of byte 13, then bytes 14..17
    data[body + 14:body + 18] = bytes(4)
    return bytes(data)


class _Budget:
    """Wall time, peak RSS growth and peak Python/numpy allocation of a block."""

    def __enter__(self):
        self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        tracemalloc.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.py_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        self.rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.rss0) * 1024
        return False


def test_declared_duration_refuses_before_decoding(three_hours_flac):
    with _Budget() as budget, pytest.raises(AudioTooLongError) as excinfo:
        load_audio(three_hours_flac, untrusted=True, max_seconds=90)
    err = excinfo.value
    assert err.exact and err.seconds == pytest.approx(10800) and err.limit == 90
    assert str(err) == "audio is longer than the 90 s limit (10800 s)"
    assert isinstance(err, AudioError) and isinstance(err, ValueError)
    assert budget.seconds < 5 and budget.rss_growth < 300 * MB and budget.py_peak < 20 * MB


def test_undeclared_duration_stops_at_the_limit(three_hours_flac):
    data = _without_total_samples(three_hours_flac)
    with av.open(io.BytesIO(data)) as container:  # really declares nothing now
        assert container.duration is None and container.streams.audio[0].duration is None
    with _Budget() as budget, pytest.raises(AudioTooLongError) as excinfo:
        load_audio(data, untrusted=True, max_seconds=90)
    err = excinfo.value
    assert not err.exact and 90 < err.seconds < 92 and err.limit == 90
    assert str(err) == "audio is longer than the 90 s limit (more than 90 s)"
    assert budget.seconds < 5 and budget.rss_growth < 300 * MB and budget.py_peak < 50 * MB


class _Pipe:
    """A non-seekable reader (like a socket) counting the bytes it hands out."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)
        self.bytes_read = 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._buf.read(n)
        self.bytes_read += len(chunk)
        return chunk


def _wav(samples: np.ndarray, rate: int, *, float32: bool, data_size: int | None = None) -> bytes:
    """A mono WAV (PCM s16 or IEEE float32) built by hand; ``data_size`` may lie."""
    data = samples.astype("<f4" if float32 else "<i2").tobytes()
    bits, tag = (32, 3) if float32 else (16, 1)
    fmt = struct.pack("<HHIIHH", tag, 1, rate, rate * bits // 8, bits // 8, bits)
    size = len(data) if data_size is None else data_size
    return (b"RIFF" + struct.pack("<I", min(36 + size, 0xFFFFFFFF)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", size) + data)


@pytest.mark.parametrize("data_size", [0xFFFFFFFF, 0, None], ids=["max", "zero", "honest"])
def test_streamed_wav_that_declares_nothing_stops_early(data_size):
    wav = _wav(np.zeros(60 * 16000), 16000, float32=False, data_size=data_size)
    pipe = _Pipe(wav)
    with pytest.raises(AudioTooLongError) as excinfo:
        load_audio(pipe, untrusted=True, max_seconds=5)
    assert not excinfo.value.exact and 5 < excinfo.value.seconds < 6
    assert pipe.bytes_read < len(wav) // 4  # the other ~50 s were never even read


def test_limits_around_the_exact_length():
    assert len(load_audio(JFK, max_seconds=11)) == 176000  # exactly at the limit: fine
    with pytest.raises(AudioTooLongError) as excinfo:  # declared 11 s is within the slack...
        load_audio(JFK, max_seconds=10.5)
    assert not excinfo.value.exact  # ...so decoding decided, at the limit
    assert str(excinfo.value) == "audio is longer than the 10.5 s limit (more than 10.5 s)"
    with pytest.raises(AudioTooLongError, match=r"^audio is longer than the 5 s limit \(11 s\)$"):
        load_audio(JFK, max_seconds=5)
    with pytest.raises(AudioTooLongError):
        load_audio(JFK, sample_rate=8000, max_seconds=10.5)


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_bad_max_seconds(bad):
    with pytest.raises(ValueError, match="max_seconds"):
        load_audio(JFK, max_seconds=bad)


def test_too_long_error_pickles():
    err = pickle.loads(pickle.dumps(AudioTooLongError(100.0, 90.0, exact=True)))
    assert (err.seconds, err.limit, err.exact, str(err)) == (
        100.0, 90.0, True, "audio is longer than the 90 s limit (100 s)")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rate", [16000, 44100])  # passthrough and resampled
def test_non_finite_float_wav_is_refused(rate, bad):
    signal = 0.1 * np.sin(np.arange(rate) / 10.0)
    signal[rate // 3] = bad
    with pytest.raises(NonFiniteAudioError, match="^audio contains NaN or infinite samples$"):
        load_audio(_wav(signal, rate, float32=True), untrusted=True)


def test_finite_float_wav_decodes_and_clips():
    signal = np.linspace(-2.0, 2.0, 16000)
    audio = load_audio(_wav(signal, 16000, float32=True))
    np.testing.assert_allclose(audio, np.clip(signal, -1, 1), atol=1e-6)


def test_cancel_before_start():
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(DecodeCancelled):
        load_audio(JFK, cancel=cancel)
    assert not issubclass(DecodeCancelled, AudioError)


def test_cancel_between_frames_stops_decoding():
    wav = _wav(np.zeros(600 * 16000), 16000, float32=False)  # 10 min
    cancel = threading.Event()

    class CancellingPipe(_Pipe):
        def read(self, n: int = -1) -> bytes:
            if self.bytes_read > 1 * MB:
                cancel.set()  # as a server would when the client disconnects
            return super().read(n)

    pipe = CancellingPipe(wav)
    with pytest.raises(DecodeCancelled):
        load_audio(pipe, cancel=cancel)
    assert pipe.bytes_read < 2 * MB < len(wav)
    assert len(load_audio(_Pipe(wav), cancel=threading.Event())) == 600 * 16000  # unset: runs
