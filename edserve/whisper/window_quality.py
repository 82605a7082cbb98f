"""openai-whisper's verdict on one decoded 30 s window: decode it again at the next
temperature (fallback), skip it as silence, or keep it.

A :class:`WindowScore` holds the three numbers ``transcribe()`` judges a window by:

- ``avg_logprob``: the log-probabilities of the window's text tokens plus that of its stop
  token (0 when it stopped by length), over ``len(tokens) + 1`` (``logprobs`` has one entry
  per text token);
- ``compression_ratio``: UTF-8 bytes of the window's text over bytes of their zlib
  compression (:func:`compression_ratio`): repetitive text (a decoding loop) scores high,
  empty text 0;
- ``no_speech_prob``: the probability of ``<|nospeech|>`` at the window's no-speech position
  (0 when unknown).

Against a :class:`~edserve.whisper.options.TranscribeOptions`' thresholds (None turns a test
off), openai-whisper's rules, its strict and non-strict comparisons included:

- :meth:`WindowScore.needs_fallback`: ``compression_ratio > compression_ratio_threshold`` or
  ``avg_logprob < logprob_threshold``, unless ``no_speech_prob > no_speech_threshold`` while
  ``avg_logprob < logprob_threshold`` (silence: no temperature will help);
- :meth:`WindowScore.is_silent`: ``no_speech_prob > no_speech_threshold`` and
  (``logprob_threshold`` is None or ``avg_logprob <= logprob_threshold``).

The caller falls back while a next temperature exists; the window it ends on (accepted or the
last temperature's) is then either silent (skipped whole) or cut into segments. Pure
functions of their arguments: no state, no engine.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from edserve.whisper.options import TranscribeOptions


def compression_ratio(text: str) -> float:
    """Bytes of ``text`` over bytes of its zlib compression (repetitive text scores high)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass(frozen=True)
class WindowScore:
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float

    @classmethod
    def of(cls, text: str, logprobs: list[float], stop_logprob: float | None,
           no_speech_prob: float | None) -> WindowScore:
        """The score of a window that decoded ``text`` (its tokens' ``logprobs``)."""
        avg_logprob = (sum(logprobs) + (stop_logprob or 0.0)) / (len(logprobs) + 1)
        return cls(avg_logprob, compression_ratio(text), no_speech_prob or 0.0)

    def _too_low(self, o: TranscribeOptions) -> bool:
        return o.logprob_threshold is not None and self.avg_logprob < o.logprob_threshold

    def _no_speech(self, o: TranscribeOptions) -> bool:
        return o.no_speech_threshold is not None and self.no_speech_prob > o.no_speech_threshold

    def needs_fallback(self, o: TranscribeOptions) -> bool:
        """Whether a next temperature should decode the window again."""
        if self._no_speech(o) and self._too_low(o):
            return False  # silence: no temperature will help
        return (o.compression_ratio_threshold is not None
                and self.compression_ratio > o.compression_ratio_threshold) or self._too_low(o)

    def is_silent(self, o: TranscribeOptions) -> bool:
        """Whether the window is skipped as silence (no segments; the next window follows)."""
        return self._no_speech(o) and (
            o.logprob_threshold is None or self.avg_logprob <= o.logprob_threshold)
