"""openai-whisper's per-window rules (edserve.whisper.window_quality): fallback and silence."""

from __future__ import annotations

import pytest

from edserve.whisper.options import TranscribeOptions
from edserve.whisper.window_quality import WindowScore, compression_ratio

OPTS = TranscribeOptions()  # ratio 2.4, log-prob -1.0, no-speech 0.6


def test_score_averages_over_the_tokens_and_the_stop_token():
    s = WindowScore.of("hello", [-1.0, -2.0], -0.5, None)
    assert s.avg_logprob == pytest.approx(-3.5 / 3) and s.no_speech_prob == 0.0
    assert WindowScore.of("", [], None, 0.3).avg_logprob == 0.0
    assert compression_ratio("") == 0.0 and compression_ratio("ab " * 100) > 2.4


@pytest.mark.parametrize("ratio, logprob, no_speech, fallback, silent", [
    (1.0, -0.5, 0.1, False, False),  # a good window
    (3.0, -0.5, 0.1, True, False),  # repetition
    (1.0, -1.5, 0.1, True, False),  # unlikely text
    (1.0, -1.5, 0.9, False, True),  # silence: no fallback, skipped
    (3.0, -0.5, 0.9, True, False),  # likely text under a high no-speech: kept
    (1.0, -1.0, 0.9, False, True),  # at the log-prob threshold: not low, yet silent (<=)
    (1.0, -1.0, 0.6, False, False),  # at the no-speech threshold: speech (>)
])
def test_fallback_and_silence_rules(ratio, logprob, no_speech, fallback, silent):
    s = WindowScore(logprob, ratio, no_speech)
    assert s.needs_fallback(OPTS) is fallback
    assert s.is_silent(OPTS) is silent


def test_none_thresholds_turn_their_test_off():
    off = TranscribeOptions(compression_ratio_threshold=None, logprob_threshold=None)
    assert not WindowScore(-9.0, 9.0, 0.1).needs_fallback(off)
    assert WindowScore(-0.1, 1.0, 0.9).is_silent(off)  # no log-prob test: no-speech decides
    assert not WindowScore(-9.0, 1.0, 0.9).is_silent(TranscribeOptions(no_speech_threshold=None))
