"""load_audio: every container PyAV can write decodes back to the same 16 kHz mono signal.

Safety (allow-list, limits) is tested in test_untrusted.py, test_limits.py, test_formats.py.
"""

from __future__ import annotations

import wave
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioDecodeError, AudioError, EmptyAudioError

DATA = Path(__file__).resolve().parents[1] / "data"
JFK = DATA / "jfk.wav"
MAX_LENGTH_ERROR = 160  # samples at 16 kHz = 10 ms (codec padding the container cannot trim)


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    with wave.open(str(JFK)) as w:  # independent of the code under test
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return (pcm / 32768.0).astype(np.float32)


def _encode(samples: np.ndarray, path: Path, codec: str, rate: int, layout: str) -> None:
    """Write 16 kHz mono float ``samples`` to ``path`` with ``codec`` at ``rate``, ``layout``."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        ctx = stream.codec_context
        ctx.open()  # fixes frame_size
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 16000, 0, Fraction(1, 16000)
        resampler = av.AudioResampler(
            format=ctx.codec.audio_formats[0].name, layout=layout, rate=rate,
            frame_size=ctx.frame_size or 1024,
        )
        for f in resampler.resample(frame) + resampler.resample(None):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))


@pytest.mark.parametrize(
    "name, codec, rate, layout",
    [
        ("clip.flac", "flac", 16000, "mono"),
        ("clip.mp3", "libmp3lame", 22050, "mono"),
        ("clip.ogg", "libopus", 48000, "stereo"),
        ("clip.m4a", "aac", 44100, "stereo"),
        ("clip.wav", "pcm_s16le", 44100, "stereo"),
    ],
)
def test_containers_decode_to_the_original(tmp_path, jfk, name, codec, rate, layout):
    path = tmp_path / name
    _encode(jfk, path, codec, rate, layout)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - len(jfk)) <= MAX_LENGTH_ERROR
    assert np.abs(audio).max() <= 1.0
    n = min(len(audio), len(jfk))
    assert np.corrcoef(audio[:n], jfk[:n])[0, 1] > 0.99


def test_wav_is_bit_exact_from_path_bytes_and_file_object(jfk):
    np.testing.assert_array_equal(load_audio(JFK), jfk)
    np.testing.assert_array_equal(load_audio(str(JFK)), jfk)
    np.testing.assert_array_equal(load_audio(JFK.read_bytes()), jfk)
    with open(JFK, "rb") as f:
        np.testing.assert_array_equal(load_audio(f), jfk)


def test_other_sample_rate(jfk):
    audio = load_audio(JFK, sample_rate=8000)
    assert abs(len(audio) - len(jfk) // 2) <= 8


def _zero_length_wav(path: Path) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"")


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)), AudioDecodeError),
        (lambda p: p.write_bytes(JFK.read_bytes()[:30]), AudioDecodeError),
        (lambda p: p.write_text("this is a text file, not audio\n" * 20), AudioDecodeError),
        (lambda p: p.write_bytes(b""), EmptyAudioError),
        (_zero_length_wav, EmptyAudioError),
    ],
    ids=["random-bytes", "truncated-header", "text-file", "empty-file", "zero-length-wav"],
)
def test_bad_inputs_raise_specific_errors_naming_the_file(tmp_path, make, error):
    path = tmp_path / "upload.wav"
    make(path)
    with pytest.raises(error, match="upload.wav"):
        load_audio(path)
    with pytest.raises(error):
        load_audio(path.read_bytes())
    assert issubclass(error, AudioError) and issubclass(error, ValueError)


def test_missing_file_and_named_file_object(tmp_path):
    with pytest.raises(AudioDecodeError, match="nope.wav"):
        load_audio(tmp_path / "nope.wav")
    with pytest.raises(AudioDecodeError, match="bytes"):
        load_audio(b"\x00" * 100)
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with open(path, "rb") as f, pytest.raises(AudioDecodeError, match="notes.txt"):
        load_audio(f)


def test_callers_file_object_is_left_open_and_untrusted_empty_names_nothing(jfk):
    with open(JFK, "rb") as f:
        np.testing.assert_array_equal(load_audio(f, untrusted=True), jfk)
        assert not f.closed
    with pytest.raises(EmptyAudioError) as excinfo:
        load_audio(b"", untrusted=True)
    assert str(excinfo.value) == "the upload holds no audio samples"


def test_new_errors_are_exported():
    import edserve.audio as audio

    assert issubclass(audio.AudioTooLongError, audio.AudioError)
    assert issubclass(audio.NonFiniteAudioError, audio.AudioError)
    assert not issubclass(audio.DecodeCancelled, audio.AudioError)
    assert "wav" in audio.ALLOWED_DEMUXERS and "concat" not in audio.ALLOWED_DEMUXERS
