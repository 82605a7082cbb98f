"""Render transcriptions as text, JSON, SRT, WebVTT or OpenAI's verbose JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from edserve.whisper.language import language_name
from edserve.whisper.result import Segment, Transcription


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def segment_dict(s: Segment) -> dict[str, Any]:
    """One segment as OpenAI's verbose_json (and openai-whisper's) segment object."""
    return {"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
            "tokens": list(s.tokens), "temperature": s.temperature,
            "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
            "no_speech_prob": s.no_speech_prob}


def verbose_dict(t: Transcription, task: str = "transcribe") -> dict[str, Any]:
    """OpenAI's ``verbose_json`` body (``language`` by name: ``"english"``); with word
    timestamps also ``words``: ``[{word, start, end}]`` (OpenAI's shape: words stripped)."""
    body = {"task": task, "language": language_name(t.language),
            "duration": round(t.duration, 3), "text": t.text,
            "segments": [segment_dict(s) for s in t.segments]}
    if t.words is not None:
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for w in t.words]
    return body


def to_text(t: Transcription) -> str:
    return t.text + "\n"


def to_json(t: Transcription) -> str:
    """One line: ``file``, ``text``, ``duration``, ``language`` (code),
    ``language_probability`` (null unless detected) and timed ``segments``; with word
    timestamps also ``words``: ``[{word, start, end, probability}]`` (openai-whisper's shape:
    a word keeps its leading space, so the words concatenate to the text)."""
    segments = [{"start": s.start, "end": s.end, "text": s.text} for s in t.segments]
    body = {"file": t.source, "text": t.text, "duration": round(t.duration, 3),
            "language": t.language, "language_probability": t.language_probability,
            "segments": segments}
    if t.words is not None:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end,
                          "probability": round(w.probability, 4)} for w in t.words]
    return json.dumps(body, ensure_ascii=False) + "\n"


def to_verbose_json(t: Transcription) -> str:
    return json.dumps(verbose_dict(t), ensure_ascii=False) + "\n"


def to_srt(t: Transcription) -> str:
    cues = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate(t.segments, start=1)]
    return "\n".join(cues)


def to_vtt(t: Transcription) -> str:
    cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n"
            for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(cues)


FORMATTERS: dict[str, Callable[[Transcription], str]] = {
    "text": to_text, "json": to_json, "srt": to_srt, "vtt": to_vtt,
    "verbose_json": to_verbose_json,
}
EXTENSIONS = {"text": "txt", "json": "json", "srt": "srt", "vtt": "vtt",
              "verbose_json": "verbose.json"}
