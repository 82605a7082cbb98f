"""Streaming text deltas, temperature schedule, and the subtitle/JSON formatters."""

from __future__ import annotations

import json

import pytest

from edserve.server.text_stream import TextStream
from edserve.whisper.formats import FORMATTERS, verbose_dict
from edserve.whisper.options import TranscribeOptions, temperature_schedule
from edserve.whisper.result import Segment, Transcription, join_text


def test_text_stream_deltas_join_to_stripped_text():
    pieces = [" ", " Hello", " world ", "", "  ", "again.  "]
    ts = TextStream()
    deltas = [ts.push(p) for p in pieces]
    assert "".join(deltas) == "".join(pieces).strip() == ts.text
    assert deltas[0] == "" and deltas[1] == "Hello"


def test_temperature_schedule():
    assert temperature_schedule(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert temperature_schedule(0.5) == (0.5, 0.7, 0.9)
    assert temperature_schedule(1.0) == (1.0,)
    assert temperature_schedule(1e-6)[-1] == 0.800001  # never past 1.0 (a fuzz-found 500)
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError):
            temperature_schedule(bad)
    with pytest.raises(ValueError):
        TranscribeOptions(temperatures=())


def _transcription() -> Transcription:
    segs = [Segment(0, 0.0, 1.5, " Hello there."), Segment(1, 1.5, 3661.25, " Bye.")]
    return Transcription("a.wav", join_text(segs), 3700.0, "en", segs)


def test_srt_vtt_text_json():
    t = _transcription()
    assert FORMATTERS["srt"](t) == ("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
                                    "2\n00:00:01,500 --> 01:01:01,250\nBye.\n")
    assert FORMATTERS["vtt"](t).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n")
    assert FORMATTERS["text"](t) == "Hello there. Bye.\n"
    row = json.loads(FORMATTERS["json"](t))
    assert row["file"] == "a.wav" and row["text"] == "Hello there. Bye."
    v = verbose_dict(t)
    assert v["language"] == "english" and len(v["segments"]) == 2
    assert set(v["segments"][0]) >= {"id", "start", "end", "text", "tokens", "temperature",
                                     "avg_logprob", "compression_ratio", "no_speech_prob"}
