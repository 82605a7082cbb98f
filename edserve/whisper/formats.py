"""Render transcriptions as text, JSON, SRT or WebVTT."""

from __future__ import annotations

import json
from collections.abc import Callable

from edserve.whisper.transcribe import Transcription


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_text(t: Transcription) -> str:
    return t.text + "\n"


def to_json(t: Transcription) -> str:
    return json.dumps({"file": t.source, "text": t.text}, ensure_ascii=False) + "\n"


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
}
