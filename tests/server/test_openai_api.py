"""The official ``openai`` client against a live server: every response format, streaming,
long-form audio, models/health/metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .server_helpers import CLIPS, DATA, integrity

CUE = re.compile(r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d) --> (\d\d):(\d\d):(\d\d)[,.](\d\d\d)")
JFK = ("And so my fellow Americans ask not what your country can do for you, ask what you can "
       "do for your country.")
DURATIONS = {"jfk": 11.0, "librivox_0870": 7.1, "cards_005": 3.5}


@pytest.fixture(scope="module")
def cli_texts() -> dict[str, str]:
    """``python -m edserve transcribe --output-format json`` on the clips (one process)."""
    files = [str(DATA / f"{c}.wav") for c in CLIPS]
    out = subprocess.run([sys.executable, "-m", "edserve", "transcribe", *files,
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {row["file"].rsplit("/", 1)[-1][:-4]: row["text"] for row in rows}


def _create(client, clip: str, **kw):
    with open(DATA / f"{clip}.wav", "rb") as f:
        return client.audio.transcriptions.create(model="whisper-1", file=f, **kw)


def _cues(body: str) -> list[tuple[float, float]]:
    cues = []
    for m in CUE.finditer(body):
        g = [int(x) for x in m.groups()]
        cues.append((g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000,
                     g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000))
    return cues


def _check_cues(cues: list[tuple[float, float]], duration: float) -> None:
    assert cues
    for (start, end), nxt in zip(cues, cues[1:] + [None], strict=True):
        assert 0 <= start <= end <= duration + 1e-3
        if nxt is not None:
            assert end <= nxt[0] + 1e-3


@pytest.mark.parametrize("clip", CLIPS)
def test_json_and_text_equal_cli(client, cli_texts, clip):
    result = _create(client, clip)
    assert result.text == cli_texts[clip]
    if clip == "jfk":  # tests/data/README.md: tiny.en greedy
        assert result.text == JFK
    assert _create(client, clip, response_format="text").strip() == cli_texts[clip]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_parse_with_ordered_cues(client, fmt):
    for clip in ("jfk", "cards_005"):
        body = _create(client, clip, response_format=fmt)
        assert body.startswith("WEBVTT" if fmt == "vtt" else "1\n")
        _check_cues(_cues(body), DURATIONS[clip] + 0.01)
        words = " ".join(line for line in body.splitlines()
                         if line and not CUE.match(line) and not line.isdigit()
                         and line != "WEBVTT")
        assert "spades" in words or "country" in words


def test_verbose_json_segments(client):
    result = _create(client, "jfk", response_format="verbose_json",
                     timestamp_granularities=["segment"])
    assert result.language == "english" and result.duration == pytest.approx(11.0, abs=0.01)
    assert result.segments and "".join(s.text for s in result.segments).strip() == result.text
    for seg in result.segments:
        assert 0 <= seg.start < seg.end <= 11.0
        assert seg.tokens and seg.avg_logprob < 0 and seg.compression_ratio > 0
        assert 0 <= seg.no_speech_prob <= 1 and seg.temperature == 0.0


@pytest.mark.parametrize("clip", ["jfk", "long"])
def test_stream_deltas_concatenate_to_final_text(client, long_clip, clip):
    path = long_clip[0] if clip == "long" else DATA / f"{clip}.wav"
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=f,
                                                         stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and events[-1] is done[0] and deltas
    assert "".join(deltas) == done[0].text
    if clip == "long":
        assert len(deltas) > 2  # one per segment, across several windows
    else:
        with open(path, "rb") as f:
            assert client.audio.transcriptions.create(model="whisper-1", file=f).text \
                == done[0].text


def test_long_clip_segments_cover_audio(client, long_clip):
    path, seconds = long_clip
    assert seconds > 30
    with open(path, "rb") as f:
        result = client.audio.transcriptions.create(model="whisper-1", file=f,
                                                    response_format="verbose_json")
    segs = result.segments
    assert result.duration == pytest.approx(seconds, abs=0.01)
    _check_cues([(s.start, s.end) for s in segs], seconds)
    assert segs[0].start < 1.0 and segs[-1].end > seconds - 3.0
    assert len({s.seek for s in segs}) >= 2  # decoded in more than one 30 s window
    text = result.text.lower()
    assert text.count("country") >= 3 and text.count("spades") == 2
    with open(path, "rb") as f:
        srt = client.audio.transcriptions.create(model="whisper-1", file=f,
                                                 response_format="srt")
    _check_cues(_cues(srt), seconds)


def test_models_health_metrics(client, http):
    assert [m.id for m in client.models.list().data] == ["whisper-1"]
    assert http.get("/health").json() == {"status": "ok"}
    metrics = http.get("/metrics").text
    for name in ("edserve_queue_length", "edserve_running_requests", "edserve_kv_slots_used",
                 "edserve_kv_slots_free", "edserve_generated_tokens_total",
                 "edserve_request_latency_seconds_bucket"):
        assert name in metrics
    integrity(http)
