"""Short-form transcription (clips up to 30 s): audio -> log-mel -> engine -> text.

All inputs are submitted together, so the engine batches their encoders and decodes them in one
continuous batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioError
from edserve.audio.mel import CHUNK_LENGTH, SAMPLE_RATE, whisper_features
from edserve.engine.request import GenerateRequest, SamplingParams


class AudioTooLongError(AudioError):
    """Audio longer than the model's 30 s window (long-form needs the sequential algorithm)."""


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass
class Transcription:
    source: str
    text: str
    duration: float
    language: str
    segments: list[Segment]


def _name(item: Any, index: int) -> str:
    if isinstance(item, str | os.PathLike):
        return os.fspath(item)
    return f"<input {index}>"


def transcribe(engine: Any, inputs: list[Any], language: str | None = None,
               task: str = "transcribe", temperature: float = 0.0,
               seed: int | None = None,
               on_finish: Callable[[Any], None] | None = None) -> list[Transcription]:
    """Transcribe files, bytes or 16 kHz float arrays (each <= 30 s). Raises AudioError."""
    tok = engine.tokenizer
    n_mels = engine.model.config.num_mel_bins
    prompt = tok.sot_sequence(language, task, timestamps=False)
    audios = [a if isinstance(a, np.ndarray) else load_audio(a) for a in inputs]
    requests = []
    for i, audio in enumerate(audios):
        seconds = len(audio) / SAMPLE_RATE
        if len(audio) == 0:
            raise AudioError(f"{_name(inputs[i], i)}: audio is empty")
        if seconds > CHUNK_LENGTH:
            raise AudioTooLongError(f"{_name(inputs[i], i)}: {seconds:.1f} s is longer than "
                                    f"{CHUNK_LENGTH} s")
        requests.append(GenerateRequest(
            prompt_ids=prompt, encoder_input=whisper_features(audio, n_mels),
            sampling=SamplingParams(temperature=temperature, seed=seed),
            no_speech_pos=0, no_speech_token=tok.no_speech))
    outputs = engine.generate(requests, on_finish=on_finish)
    results = []
    for i, (audio, out) in enumerate(zip(audios, outputs, strict=True)):
        if out.error:
            raise RuntimeError(f"{_name(inputs[i], i)}: {out.error}")
        text = tok.decode(out.token_ids).strip()
        duration = len(audio) / SAMPLE_RATE
        n = len(out.token_ids)
        avg = (out.sum_logprob + (out.stop_logprob or 0.0)) / (n + 1)
        seg = Segment(0, 0.0, round(duration, 3), text, list(out.token_ids), temperature, avg,
                      0.0, out.no_speech_prob or 0.0)
        results.append(Transcription(_name(inputs[i], i), text, duration, language or "en",
                                     [seg]))
    return results
