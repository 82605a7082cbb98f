"""The front door for Python users: load a model by name, transcribe, chat.

    import edserve
    model = edserve.Whisper("tiny.en")                 # or edserve.load("base")
    result = model.transcribe("clip.wav")              # one input -> one Transcription
    print(result.text, result.language, result.segments[0].start)

Names follow faster-whisper (``WhisperModel(...).transcribe(...)``) and vLLM (``LLM(model=...)``):
the constructor takes the model and any :class:`~edserve.config.EngineConfig` field as a
keyword (``device``, ``dtype``, ``quantization``, ``page_size``, ``encoder_kv``, ...); the
engine is built once, by the composition root (:func:`edserve.runtime.build_engine`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from edserve.chat.chat_api import ChatResult, chat
from edserve.config import EngineConfig
from edserve.engine.engine import Engine
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions, temperature_schedule
from edserve.whisper.result import Transcription
from edserve.whisper.transcribe import transcribe


class _Model:
    """One engine, built from a config; closes nothing (an Engine holds no threads), so
    ``close()`` only drops the engine's memory."""

    model_type = ""  # the edserve.models registry key this front door serves

    def __init__(self, model: str | None = None, *, engine: Engine | None = None,
                 **config: Any) -> None:
        if engine is None:
            engine = build_engine(EngineConfig(model=model, **config))
        elif model is not None or config:
            raise TypeError("give either an engine or a model + config, not both")
        kind = getattr(engine.model, "model_type", None)
        if kind != self.model_type:
            raise ValueError(f"{type(self).__name__} serves {self.model_type} models; "
                             f"this model is {kind!r} (edserve.load picks the right class)")
        self.engine = engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        self.engine = None  # type: ignore[assignment]

    def __enter__(self) -> _Model:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Whisper(_Model):
    """Speech recognition and translation with a Whisper model (default: embedded tiny.en)."""

    model_type = "whisper"

    @property
    def is_multilingual(self) -> bool:
        return bool(getattr(self.tokenizer, "is_multilingual", False))

    def transcribe(self, audio: Any, *, language: str | None = None,
                   task: str = "transcribe", beam_size: int = 5, best_of: int = 5,
                   temperature: float = 0.0, word_timestamps: bool = False,
                   seed: int | None = None, **options: Any
                   ) -> Transcription | list[Transcription]:
        """Transcribe (or, ``task="translate"``, translate to English) audio of any length.

        ``audio``: a path, bytes, or a 16 kHz mono float32 array, or a list of them (then a
        list of results, in order, decoded together in one continuous batch). ``language``
        None on a multilingual model: detected on the first 30 s. ``beam_size`` beams at
        temperature 0 and ``best_of`` samples above it (5 and 5, like faster-whisper's and
        openai-whisper's CLIs; 1 and 1 is greedy, faster). ``temperature`` starts the fallback
        schedule ``t, t + 0.2, ... 1.0``. Any other :class:`TranscribeOptions` field may be
        given by name (``initial_prompt``, ``condition_on_previous_text``,
        ``compression_ratio_threshold``, ``timestamps``, ...); an unknown name is a TypeError.
        Unusable audio raises :class:`~edserve.audio.errors.AudioError`.
        """
        single = isinstance(audio, str | bytes | os.PathLike | np.ndarray)
        inputs = [audio] if single else list(audio)
        opts = TranscribeOptions(
            language=language, task=task, temperatures=temperature_schedule(temperature),
            seed=self.engine.config.seed if seed is None else seed, beam_size=beam_size,
            best_of=best_of, word_timestamps=word_timestamps, **options)
        results = transcribe(self.engine, inputs, options=opts)
        return results[0] if single else results


class VisionChat(_Model):
    """Chat about images with a Llama-3.2-Vision (Mllama) model folder."""

    model_type = "mllama"

    def chat(self, messages: Sequence[Any], *, max_tokens: int | None = None,
             temperature: float = 0.0, seed: int | None = None,
             stop: str | Sequence[str] | None = None, top_p: float = 1.0,
             **options: Any) -> ChatResult:
        """One chat completion over OpenAI-style ``messages`` (image parts may be ``data:``
        URLs, PIL images, bytes or file paths). ``options``: the other keywords of
        :func:`edserve.chat.chat_api.chat` (``response_format``, ``tools``, ``tool_choice``,
        ``logit_bias``, penalties, ``top_logprobs``)."""
        return chat(self.engine, messages, max_tokens=max_tokens, temperature=temperature,
                    seed=seed, stop=stop, top_p=top_p, **options)


_FRONT_DOORS = {cls.model_type: cls for cls in (Whisper, VisionChat)}


def load(model: str | None = None, **config: Any) -> Whisper | VisionChat:
    """Build the model's engine and return its front door: :class:`Whisper` for Whisper
    models, :class:`VisionChat` for Llama-3.2-Vision. ``config``: EngineConfig fields."""
    engine = build_engine(EngineConfig(model=model, **config))
    kind = getattr(engine.model, "model_type", None)
    if kind not in _FRONT_DOORS:
        raise ValueError(f"no front door for model type {kind!r}; use edserve.build_engine")
    return _FRONT_DOORS[kind](engine=engine)
