"""Whisper speech recognition on top of the engine: transcription driver and output formats."""

from edserve.whisper.transcribe import Segment, Transcription, transcribe

__all__ = ["Segment", "Transcription", "transcribe"]
