"""The sequential long-form state machine, fed with hand-made engine outputs (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import FinishReason
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.window_quality import compression_ratio

SECONDS = 45.0


def _task(tok, seconds: float = SECONDS, **opts) -> LongformTask:
    audio = np.random.default_rng(0).normal(0, 0.05, int(16000 * seconds)).astype(np.float32)
    return LongformTask(audio, tok, 80, TranscribeOptions(**opts), 448, "x.wav")


def _out(tokens, lp=-0.1, no_speech=0.01, reason=FinishReason.STOP, error=None):
    return GenerateOutput("r", list(tokens), [lp] * len(tokens), reason, no_speech, error, lp)


def test_first_request(tok):
    task = _task(tok)
    req = task.next_request()
    assert task.timestamps  # longer than one window: timestamps on
    assert req.prompt_ids == [tok.sot] and req.no_speech_pos == 0
    assert tuple(req.encoder_input.shape) == (80, 3000)
    assert req.sampling.temperature == 0.0 and req.sampling.max_new_tokens == 224
    assert not _task(tok, 10.0).timestamps  # a short clip decodes without timestamps


def test_unfinished_segment_is_redecoded(tok):
    tb, hello, world = tok.timestamp_begin, tok.encode(" hello"), tok.encode(" world")
    task = _task(tok)
    task.next_request()
    segs = task.feed(_out([tb, *hello, tb + 250, tb + 250, *world, tb + 400, *hello]))
    assert [(s.start, s.end, s.text) for s in segs] == [(0.0, 5.0, " hello")]
    assert task.seek == 500  # seek to the last complete timestamp (5 s = 500 frames)


def test_single_timestamp_ending_consumes_window(tok):
    tb, hello, world = tok.timestamp_begin, tok.encode(" hello"), tok.encode(" world")
    task = _task(tok)
    task.next_request()
    segs = task.feed(_out([tb, *hello, tb + 250, tb + 250, *world, tb + 400]))
    assert [(s.id, s.start, s.end) for s in segs] == [(0, 0.0, 5.0), (1, 5.0, 8.0)]
    assert task.seek == 3000
    req = task.next_request()  # second window: 15 s left, times offset by 30 s
    segs = task.feed(_out([tb, *world, tb + 100]))
    assert [(s.id, s.start, s.end, s.seek) for s in segs] == [(2, 30.0, 32.0, 3000)]
    assert req is not None and task.done and task.next_request() is None
    assert task.result().text == "hello world world"


def test_times_clamped_to_duration(tok):
    tb, hello = tok.timestamp_begin, tok.encode(" hello")
    task = _task(tok, 5.0, timestamps=True)
    task.next_request()
    [seg] = task.feed(_out([tb, *hello, tb + 1000]))  # claims 20 s in a 5 s clip
    assert seg.end == 5.0 and task.done


def test_temperature_fallback_on_repetition(tok):
    rep = tok.encode(" the same words again and again") * 20
    assert compression_ratio(tok.decode(rep)) > 2.4
    task = _task(tok, 10.0)
    task.next_request()
    assert task.feed(_out(rep)) == [] and task.temperature == 0.2 and task.seek == 0
    req = task.next_request()
    assert req.sampling.temperature == 0.2 and req.sampling.seed is not None
    segs = task.feed(_out(tok.encode(" fine")))
    assert segs[0].temperature == 0.2 and task.temperature == 0.0 and task.done


def test_fallback_exhausted_keeps_last_result(tok):
    task = _task(tok, 10.0, temperatures=(0.0, 0.5))
    task.next_request()
    task.feed(_out(tok.encode(" mumble"), lp=-3.0))
    task.next_request()
    [seg] = task.feed(_out(tok.encode(" mumble"), lp=-3.0))
    assert seg.temperature == 0.5 and seg.avg_logprob == pytest.approx(-3.0)


def test_silence_is_skipped_without_fallback(tok):
    task = _task(tok)
    task.next_request()
    assert task.feed(_out(tok.encode(" you"), lp=-2.0, no_speech=0.9)) == []
    assert task.seek == 3000 and task.temperature == 0.0
    # confident text overrides a high no-speech probability
    task.next_request()
    assert task.feed(_out([tok.timestamp_begin, *tok.encode(" yes"),
                           tok.timestamp_begin + 50], no_speech=0.9))


def test_failed_or_aborted_window_raises(tok):
    task = _task(tok)
    task.next_request()
    with pytest.raises(RuntimeError, match="boom"):
        task.feed(_out([], reason=FinishReason.ERROR, error="boom"))
    with pytest.raises(RuntimeError):
        task.feed(_out([], reason=FinishReason.ABORT))


def test_prompts_and_conditioning(tok):
    tb, hello = tok.timestamp_begin, tok.encode(" hello")
    task = _task(tok, condition_on_previous_text=True, initial_prompt="Names: Dashwood.")
    first = task.next_request()
    initial = tok.encode(" Names: Dashwood.")
    assert first.prompt_ids == [tok.sot_prev, *initial, tok.sot]
    assert first.no_speech_pos == len(initial) + 1
    window = [tb, *hello, tb + 250, tb + 250]
    task.feed(_out(window + hello))
    second = task.next_request()
    assert second.prompt_ids == [tok.sot_prev, *initial, *window[:3], tok.sot]
    plain = _task(tok, initial_prompt="Names: Dashwood.")  # prompt only for the first window
    plain.next_request()
    plain.feed(_out(window + hello))
    assert plain.next_request().prompt_ids == [tok.sot]


class _FakeAligner:
    """Each text token k attends to encoder frames 25k..25k+24 (0.5 s per token)."""

    heads = [(0, 0)]

    def capture(self, kv, sot_seq, text_tokens, eot):
        from edserve.whisper.cross_weights import Alignment

        rows = len(sot_seq) + len(text_tokens) + 1
        w = np.full((1, rows, 1500), 1e-4, dtype=np.float32)
        for k in range(len(text_tokens) + 1):
            w[0, len(sot_seq) - 1 + k, 25 * k:25 * (k + 1)] = 1.0
        import torch

        return Alignment(torch.from_numpy(w / w.sum(-1, keepdims=True)), [0.5] * len(text_tokens))


def test_word_timestamps_move_segments_and_seek(tok):
    """A window that ends on a pair of timestamps: the next window starts at the last word's
    end (not at the last timestamp); words concatenate to the segment texts; the unfinished
    segment's tokens are not aligned."""
    tb, hello, world = tok.timestamp_begin, tok.encode(" hello"), tok.encode(" world there")
    task = LongformTask(np.zeros(16000 * 45, np.float32), tok, 80,
                        TranscribeOptions(word_timestamps=True), 448, "x", _FakeAligner())
    req = task.next_request()
    tokens = [tb, *hello, tb + 50, tb + 50, *world, tb + 300, tb + 300, *hello]
    readout = req.readout  # what the engine runs at the window's finish (a request field)
    assert readout.heads == ((0, 0),) and readout.forced == 0
    assert readout.sot_seqs == {None: tuple(tok.sot_sequence("en", "transcribe", False))}
    al = _FakeAligner().capture(None, readout.sot_seqs[None], [*hello, *world], tok.eot)
    segs = task.feed(GenerateOutput(req.rid, tokens, [-0.1] * len(tokens), FinishReason.STOP,
                                    0.01, None, -0.1, readout=al))
    assert ["".join(w.word for w in s.words) for s in segs] == [" hello", " world there"]
    words = [(w.word, w.start, w.end) for s in segs for w in s.words]
    assert words == [(" hello", 0.0, 0.5), (" world", 0.5, 1.0), (" there", 1.0, 1.5)]
    assert (segs[0].start, segs[0].end, segs[1].start, segs[1].end) == (0.0, 0.5, 0.5, 1.5)
    assert task.seek == 150  # last word end 1.5 s, not the 6 s timestamp
    assert task.result().words[-1].word == " there"
    with pytest.raises(ValueError, match="aligner"):
        LongformTask(np.zeros(16000, np.float32), tok, 80,
                     TranscribeOptions(word_timestamps=True))
