"""The container allow-list: every allowed format PyAV can write decodes as an untrusted upload."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.audio.formats import ALLOWED_DEMUXERS, EXACT_DURATION_DEMUXERS

RATE = 16000
MAX_DELAY = 4096  # codec priming some containers cannot trim (raw ADTS, AC-3, MPEG-TS)


@pytest.fixture(scope="module")
def chirp() -> np.ndarray:
    """1 s, 200 -> 3000 Hz: not periodic, so a correlation peak pins the alignment."""
    t = np.arange(RATE) / RATE
    return (0.4 * np.sin(2 * np.pi * (200 * t + 1400 * t**2))).astype(np.float32)


def _encode(samples: np.ndarray, muxer: str, codec: str, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        ctx = stream.codec_context
        ctx.open()  # fixes frame_size
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, 0, Fraction(1, RATE)
        resampler = av.AudioResampler(
            format=ctx.codec.audio_formats[0].name, layout="mono", rate=rate,
            frame_size=ctx.frame_size or 1024,
        )
        for f in resampler.resample(frame) + resampler.resample(None):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    return buf.getvalue()


CASES = [  # (muxer, encoder, sample rate, demuxer FFmpeg will probe)
    ("wav", "pcm_s16le", 44100, "wav"),
    ("wav", "pcm_f32le", 22050, "wav"),
    ("w64", "pcm_s16le", 16000, "w64"),
    ("aiff", "pcm_s16be", 16000, "aiff"),
    ("caf", "pcm_s16le", 16000, "caf"),
    ("au", "pcm_s16be", 16000, "au"),
    ("flac", "flac", 16000, "flac"),
    ("wv", "wavpack", 16000, "wv"),
    ("mp3", "libmp3lame", 22050, "mp3"),
    ("ogg", "libopus", 48000, "ogg"),
    ("ogg", "flac", 16000, "ogg"),
    ("ipod", "aac", 44100, "mov,mp4,m4a,3gp,3g2,mj2"),
    ("mov", "alac", 16000, "mov,mp4,m4a,3gp,3g2,mj2"),
    ("matroska", "flac", 16000, "matroska,webm"),
    ("webm", "libopus", 48000, "matroska,webm"),
    ("adts", "aac", 16000, "aac"),
    ("ac3", "ac3", 48000, "ac3"),
    ("asf", "pcm_s16le", 16000, "asf"),
    ("mpegts", "aac", 48000, "mpegts"),
    ("avi", "pcm_s16le", 16000, "avi"),
]


@pytest.mark.parametrize("muxer, codec, rate, demuxer", CASES,
                         ids=[f"{m}-{c}" for m, c, _, _ in CASES])
def test_allowed_formats_decode_as_untrusted_uploads(chirp, muxer, codec, rate, demuxer):
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    if muxer not in av.formats_available:
        pytest.skip(f"this FFmpeg build has no {muxer} muxer")
    data = _encode(chirp, muxer, codec, rate)
    with av.open(io.BytesIO(data)) as container:
        assert container.format.name == demuxer
    assert demuxer in ALLOWED_DEMUXERS

    audio = load_audio(data, untrusted=True, max_seconds=2)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(chirp) - 160 <= len(audio) <= len(chirp) + MAX_DELAY
    padded = np.pad(audio, (0, len(chirp) + MAX_DELAY - len(audio)))
    scores = np.correlate(padded, chirp, "valid") / (np.linalg.norm(chirp) ** 2)  # per lag
    assert scores.max() > 0.95  # the chirp is there at some codec delay, at its level


def test_allow_list_is_real_and_excludes_demuxers_that_open_other_inputs():
    opening = {"concat", "hls", "dash", "image2", "image2pipe", "webm_dash_manifest",
               "tee", "lavfi", "ffmetadata", "sdp", "rtsp", "rtp", "mpjpeg", "data"}
    names = {part for name in ALLOWED_DEMUXERS for part in name.split(",")}
    assert not names & opening
    assert not any(n.endswith("_pipe") for n in names)
    assert EXACT_DURATION_DEMUXERS <= ALLOWED_DEMUXERS
    for name in ALLOWED_DEMUXERS:  # every entry names a demuxer this FFmpeg has
        assert av.ContainerFormat(name.split(",")[0], "r").name
