"""Each segment carries its tokens' log-probabilities (``Segment.token_logprobs``): cut with
the tokens at timestamp pairs, from the accepted attempt of a fallback, with a detecting
window's forced language tokens left out; ``text_logprobs`` keeps the text tokens."""

from __future__ import annotations

import numpy as np
import pytest

from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import FinishReason
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.result import Segment


def _task(tok, seconds: float, **opts) -> LongformTask:
    audio = np.random.default_rng(0).normal(0, 0.05, int(16000 * seconds)).astype(np.float32)
    return LongformTask(audio, tok, 80, TranscribeOptions(**opts), 448, "x.wav")


def _out(tokens, lps) -> GenerateOutput:
    return GenerateOutput("r", list(tokens), list(lps), FinishReason.STOP, 0.01, None, -0.1)


def test_cut_with_the_tokens_at_timestamp_pairs(tok):
    tb, hello, world = tok.timestamp_begin, tok.encode(" hello"), tok.encode(" world")
    tokens = [tb, *hello, tb + 250, tb + 250, *world, tb + 400, *hello]
    lps = [-0.01 * (i + 1) for i in range(len(tokens))]
    task = _task(tok, 45.0)
    task.next_request()
    [seg] = task.feed(_out(tokens, lps))  # the unfinished " hello" is decoded again
    n = len(hello) + 2
    assert seg.tokens == tokens[:n] and seg.token_logprobs == lps[:n]
    assert seg.text_logprobs(tok.eot) == list(zip(hello, lps[1:n - 1], strict=True))
    task.next_request()
    [seg2] = task.feed(_out([tb, *world, tb + 100], [-0.5] * (len(world) + 2)))
    assert seg2.text_logprobs(tok.eot) == [(t, -0.5) for t in world]


def test_fallback_keeps_the_accepted_attempts(tok):
    task = _task(tok, 10.0, temperatures=(0.0, 0.5))
    mumble = tok.encode(" mumble mumble")
    task.next_request()
    assert task.feed(_out(mumble, [-3.0] * len(mumble))) == []  # too unlikely: again
    task.next_request()
    lps = [-0.2 - 0.01 * i for i in range(len(mumble))]
    [seg] = task.feed(_out(mumble, lps))
    assert seg.temperature == 0.5 and seg.token_logprobs == lps


def test_detected_language_tokens_are_not_text(tok):
    """A multilingual-like detecting window: the forced <|lang|> ... tokens are stripped from
    the tokens and their log-probabilities alike (English-only here: no detection, so the
    plain path; the stripping is checked on ``_take_language`` directly)."""
    task = _task(tok, 10.0)
    task._sot_seq = [tok.sot, tok.transcribe, tok.no_timestamps]  # no language yet
    hello = tok.encode(" hello")
    forced = [tok.language_token("en"), tok.transcribe, tok.no_timestamps]  # then the text
    tokens, lps = task._take_language(forced + hello, [-0.1, -0.2, -0.05]
                                      + [-0.3] * len(hello))
    assert tokens == hello and lps == [-0.3] * len(hello)


def test_hand_made_segment_without_logprobs_refuses(tok):
    assert Segment(0, 0.0, 1.0, " hi").text_logprobs(tok.eot) == []
    with pytest.raises(ValueError, match="log-probabilities"):
        Segment(0, 0.0, 1.0, " hi", tokens=tok.encode(" hi")).text_logprobs(tok.eot)
