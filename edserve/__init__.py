"""edserve: a serving engine for encoder-decoder models with a paged KV cache.

The public API (imported on first use, so ``import edserve`` stays light):

- offline jobs: :func:`load`, :class:`Whisper` (``.transcribe``), :class:`VisionChat`
  (``.chat``), with results :class:`Transcription` / :class:`Segment` / :class:`Word` and
  :class:`ChatResult`, and :class:`TranscribeOptions`;
- integrators: :func:`build_engine` (the composition root) -> :class:`Engine`, configured by
  :class:`EngineConfig`, fed :class:`GenerateRequest` with :class:`SamplingParams`, returning
  :class:`GenerateOutput`; :class:`AsyncEngine` runs it on a background loop;
  :class:`LogitsFilter` is the batched logits-processor contract.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "edserve.api", "Whisper": "edserve.api", "VisionChat": "edserve.api",
    "Transcription": "edserve.whisper.result", "Segment": "edserve.whisper.result",
    "Word": "edserve.whisper.result", "TranscribeOptions": "edserve.whisper.options",
    "ChatResult": "edserve.chat.chat_api",
    "build_engine": "edserve.runtime", "Engine": "edserve.engine.engine",
    "AsyncEngine": "edserve.engine.async_engine", "EngineConfig": "edserve.config",
    "GenerateRequest": "edserve.engine.request", "SamplingParams": "edserve.engine.request",
    "GenerateOutput": "edserve.engine.request",
    "LogitsFilter": "edserve.engine.logits_filter",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
