"""Decoding options for Whisper transcription (openai-whisper's ``transcribe`` defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edserve.config import check_mel_padding

TEMPERATURE_INCREMENT = 0.2


def temperature_schedule(start: float, increment: float = TEMPERATURE_INCREMENT
                         ) -> tuple[float, ...]:
    """``start, start + increment, ... <= 1.0``: the temperatures tried on fallback."""
    if not 0.0 <= start <= 1.0:
        raise ValueError(f"temperature must be in [0, 1], got {start}")
    temps, t = [], start
    while round(t, 6) <= 1.0:  # rounded: 0.8 + 0.2 is 1.0000000000000002, 1e-6 + 1.0 is not 1
        temps.append(round(t, 6))
        t += increment
    return tuple(temps)


@dataclass(frozen=True)
class TranscribeOptions:
    """How one audio is transcribed.

    ``temperatures`` is the fallback schedule: a window is decoded again at the next
    temperature when its compression ratio exceeds ``compression_ratio_threshold`` (repetition)
    or its average log-probability is below ``logprob_threshold``. A window whose
    ``no_speech_prob`` exceeds ``no_speech_threshold`` while its average log-probability is
    below ``logprob_threshold`` is treated as silence and skipped.

    ``word_timestamps``: time every word (openai-whisper's cross-attention + DTW method, see
    :mod:`edserve.whisper.longform`); results then carry ``Segment.words`` and
    ``Transcription.words``, segment times follow the words, and the next window starts at the
    last word's end.

    ``mel_padding``: how a window shorter than 30 s (a clip under 30 s, the last window of
    longer audio) is laid out, see :func:`edserve.audio.mel.window_features`: ``silence`` (the
    log-mel of the audio followed by silence; the default, the lower WER on the shared clips)
    or ``zeros`` (the audio's frames, zero-filled to 3000: openai-whisper's ``transcribe()``
    and faster-whisper, token for token). Language detection sees the same layout.
    """

    language: str | None = None
    task: str = "transcribe"
    temperatures: tuple[float, ...] = temperature_schedule(0.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    # openai-whisper defaults to True; off here because tiny models often repeat the previous
    # window's text when prompted with it (seen on tests/data clips joined with pauses).
    condition_on_previous_text: bool = False
    initial_prompt: str | None = None
    max_initial_timestamp: float = 1.0
    suppress_blank: bool = True
    # Decode timestamp tokens? None: only for audio longer than one 30 s window (short clips
    # then decode like openai-whisper's ``without_timestamps`` and give one segment).
    timestamps: bool | None = None
    seed: int = 0  # base seed for sampling at temperature > 0 (varied per window)
    max_new_tokens: int | None = None  # default: half the decoder context (openai's sample_len)
    word_timestamps: bool = False
    # Windows decoded at temperature 0 use beam search with ``beam_size`` beams (1: greedy);
    # at temperature > 0, ``best_of`` samples. The best sequence has the highest sum
    # log-probability / length penalty (None: the length; else ((5 + n) / 6) ** penalty).
    # openai-whisper's and faster-whisper's CLIs use beam_size 5 and best_of 5.
    beam_size: int = 1
    best_of: int = 1
    patience: float | None = None
    length_penalty: float | None = None
    mel_padding: str = "silence"

    @property
    def may_fall_back(self) -> bool:
        """A window can be decoded again: a next temperature exists and a threshold can be
        crossed (``inf`` / ``-inf`` thresholds, as servers pass to turn fallback off, never
        are; nor is None)."""
        ratio = self.compression_ratio_threshold
        logprob = self.logprob_threshold
        return len(self.temperatures) > 1 and (
            (ratio is not None and ratio != math.inf)
            or (logprob is not None and logprob != -math.inf))

    def __post_init__(self) -> None:
        check_mel_padding(self.mel_padding)
        if not self.temperatures:
            raise ValueError("temperatures must not be empty")
        for t in self.temperatures:
            if not 0.0 <= t <= 1.0:
                raise ValueError(f"temperature must be in [0, 1], got {t}")
        from edserve.engine.request import SamplingParams  # the same checks as the engine's

        SamplingParams(beam_size=self.beam_size, patience=self.patience,
                       length_penalty=self.length_penalty)
        SamplingParams(temperature=1.0, best_of=self.best_of)
