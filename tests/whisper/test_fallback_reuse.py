"""Temperature fallback reuses the window's encoder KV: the encoder runs once per window (a
counter), the transcript equals the path that re-encodes every retry, and every handle is
released (no KV held after the run, also when a window fails)."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import DATA

from edserve.audio.decode import load_audio
from edserve.engine.engine import Engine
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import EncoderKV, FinishReason
from edserve.runtime import build_engine
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, run_tasks

CLIPS = ["jfk", "cards_005"]
# logprob_threshold 0: every window's average log-probability is below it, so each window is
# decoded at all three temperatures (the last one is accepted).
FORCED = TranscribeOptions(temperatures=(0.0, 0.2, 0.4), logprob_threshold=0.0,
                           beam_size=2, best_of=2, seed=3)


@pytest.fixture(scope="module")
def audios():
    return [load_audio(DATA / f"{c}.wav") for c in CLIPS]


def _run(engine: Engine, audios, reuse: bool):
    tasks = []
    for a, name in zip(audios, CLIPS, strict=True):
        task = make_task(engine, a, FORCED, name)
        task.reuse_encoder = reuse
        tasks.append(task)
    before = engine.runner.num_encoded_inputs
    run_tasks(engine, tasks)
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0 and not engine.scheduler.held
    return [t.result() for t in tasks], engine.runner.num_encoded_inputs - before


@pytest.mark.parametrize("strategy,page_size", [("flat", "128"), ("aligned", "16")])
def test_fallback_encodes_each_window_once(audios, strategy, page_size):
    engine = build_engine(encoder_kv=strategy, page_size=page_size, max_running_requests=8,
                    debug_checks=True)
    reused, encoded = _run(engine, audios, reuse=True)
    assert encoded == len(CLIPS)  # one encoder pass per window, not one per temperature
    fresh, encoded_fresh = _run(engine, audios, reuse=False)
    assert encoded_fresh == 3 * len(CLIPS)
    for a, b in zip(reused, fresh, strict=True):
        assert [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
        assert a.segments[0].temperature == 0.4  # the fallback really ran to the end
        assert a.text == b.text


def test_failed_window_hands_its_handle_back():
    """A task that holds a handle and then sees a failed retry gives the handle back."""
    from whisper_fixtures import tokenizer_json

    from edserve.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.from_file(str(tokenizer_json()))
    task = LongformTask(torch.zeros(16000).numpy(), tok, 80, FORCED, reuse_encoder=True)
    req = task.next_request()
    assert req.keep_encoder and req.encoder_kv is None
    handle = EncoderKV(torch.arange(1500), 1500, 1500)
    task.feed(GenerateOutput(req.rid, [tok.encode(" hi")[0]], [-3.0], FinishReason.STOP,
                             0.0, None, -3.0, handle))
    assert task.take_released() == []  # a retry follows: still held
    retry = task.next_request()
    assert retry.encoder_kv is handle and not retry.keep_encoder
    with pytest.raises(RequestFailed):
        task.feed(GenerateOutput(retry.rid, [], [], FinishReason.ERROR, error="boom"))
    assert task.take_released() == [handle]
    assert task.abandon() == []


@pytest.mark.parametrize("opts,keeps", [
    (TranscribeOptions(), True),  # the defaults can fall back
    (TranscribeOptions(temperatures=(0.0,)), False),  # no next temperature
    (TranscribeOptions(compression_ratio_threshold=float("inf"),
                       logprob_threshold=float("-inf")), False),  # servers' "fallback off"
    (TranscribeOptions(compression_ratio_threshold=None, logprob_threshold=None), False),
    (TranscribeOptions(compression_ratio_threshold=float("inf")), True),  # logprob still can
])
def test_a_handle_is_kept_only_when_a_retry_can_happen(opts, keeps):
    """Keeping the encoder costs a release later (and pages held meanwhile): only for windows
    that may be decoded again."""
    from whisper_fixtures import tokenizer_json

    from edserve.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.from_file(str(tokenizer_json()))
    task = LongformTask(torch.zeros(16000).numpy(), tok, 80, opts, reuse_encoder=True)
    assert opts.may_fall_back == keeps
    assert task.next_request().keep_encoder == keeps
