"""The FFmpeg-free read of 16-bit PCM mono WAV: the same samples as the FFmpeg path, and every
other file (or a malformed one) handed to FFmpeg unchanged."""

from __future__ import annotations

import io
import re
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

import edserve.audio.decode as decode
from edserve.audio.decode import UNTRUSTED_DECODE_MESSAGE, load_audio
from edserve.audio.errors import AudioDecodeError, AudioTooLongError
from edserve.audio.wav_pcm import read_pcm_wav

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


def _wav(pcm: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _ffmpeg(data: bytes, **kw) -> np.ndarray:
    return load_audio(io.BytesIO(data), **kw)  # a file object always goes through FFmpeg


@pytest.fixture
def no_ffmpeg(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("FFmpeg was opened for a plain PCM WAV")
    monkeypatch.setattr(decode, "open_container", refuse)


def test_jfk_bytes_and_path_skip_ffmpeg(no_ffmpeg):
    data = JFK.read_bytes()
    fast = load_audio(data, untrusted=True)
    assert fast.dtype == np.float32 and fast.shape == (176000,)
    assert np.array_equal(fast, load_audio(JFK))


def test_jfk_equals_the_ffmpeg_samples():
    np.testing.assert_array_equal(load_audio(JFK.read_bytes()), _ffmpeg(JFK.read_bytes()))


def test_full_scale_values_equal_ffmpeg_bit_for_bit():
    rng = np.random.default_rng(0)
    pcm = np.concatenate([np.array([-32768, 32767, 0, 1, -1], dtype="<i2"),
                          rng.integers(-32768, 32768, 16000, dtype=np.int64).astype("<i2")])
    data = _wav(pcm)
    fast = read_pcm_wav(io.BytesIO(data), 16000, None, 1.0)
    assert fast is not None
    np.testing.assert_array_equal(fast, _ffmpeg(data))
    assert fast[0] == -1.0 and fast[1] == np.float32(32767 / 32768)


@pytest.mark.parametrize("kind", ["stereo", "8 kHz", "24-bit", "8-bit", "truncated", "empty",
                                  "not wav"])
def test_other_files_go_to_ffmpeg(kind):
    pcm = (np.sin(np.arange(8000) / 7.0) * 8000).astype("<i2")
    data = {
        "stereo": lambda: _wav(np.repeat(pcm, 2), channels=2),
        "8 kHz": lambda: _wav(pcm, rate=8000),
        "24-bit": lambda: _wav(np.frombuffer(b"\x01\x02\x03" * 4000, dtype=np.uint8),
                               width=3),
        "8-bit": lambda: _wav((pcm // 256 + 128).astype(np.uint8), width=1),
        "truncated": lambda: _wav(pcm)[:-1001],
        "empty": lambda: _wav(pcm[:0]),
        "not wav": lambda: b"RIFF" + struct.pack("<I", 100) + b"WAVEjunk" + b"\x00" * 100,
    }[kind]()
    assert read_pcm_wav(io.BytesIO(data), 16000, None, 1.0) is None
    if kind in ("stereo", "8 kHz", "truncated"):  # still decodable: FFmpeg gives the samples
        assert load_audio(data).size > 0
    if kind == "not wav":
        with pytest.raises(AudioDecodeError, match=re.escape(UNTRUSTED_DECODE_MESSAGE)):
            load_audio(data, untrusted=True)


def test_too_long_is_refused_from_the_header_like_ffmpeg():
    data = JFK.read_bytes()
    with pytest.raises(AudioTooLongError) as fast:
        load_audio(data, max_seconds=5.0, untrusted=True)
    with pytest.raises(AudioTooLongError) as slow:
        _ffmpeg(data, max_seconds=5.0, untrusted=True)
    assert fast.value.exact and slow.value.exact
    assert str(fast.value) == str(slow.value)
    # within the slack (11 s file, 10.5 s limit): FFmpeg decodes up to the limit and decides
    assert read_pcm_wav(io.BytesIO(data), 16000, 10.5, 1.0) is None
    assert load_audio(data, max_seconds=11.0).size == 176000


def test_a_wav_of_another_layout_is_read_no_further_than_its_header():
    class Counting(io.BytesIO):
        taken = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.taken += len(out)
            return out

    stereo = _wav(np.zeros(2 * 160000, dtype="<i2"), channels=2)  # 10 s, 640 kB
    f = Counting(stereo)
    assert read_pcm_wav(f, 16000, None, 1.0) is None
    assert Counting.taken < 1024  # the header only; FFmpeg reads the samples
