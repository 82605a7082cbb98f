"""Overlap scheduling (step N+1 prepared before step N's tokens are read) gives exactly the
outputs of the plain schedule -> run -> update loop: greedy, seeded sampling, stop tokens at
different steps, length limits, and real transcription with the Whisper filters."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import DATA, TINY_EN_TEXT

from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

PROMPT = [50257, 50362]


def _requests(stops: list[int] | None = None) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(6):
        mel = torch.randn(80, 3000, generator=gen) * 0.5
        sp = SamplingParams(temperature=0.8 if i % 3 == 2 else 0.0, seed=i, top_p=0.9,
                            max_new_tokens=4 + 3 * i, ignore_eos=True,
                            stop_token_ids=(stops[i],) if stops else ())
        reqs.append(GenerateRequest(PROMPT, mel, sp))
    return reqs


def _outputs(engine: Engine, reqs: list[GenerateRequest]):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in engine.generate(reqs)]


def test_overlap_matches_plain_schedule(random_whisper):
    plain = build_engine(model=str(random_whisper), page_size="16", max_running_requests=4,
                   overlap_schedule="off")
    overlap = build_engine(model=str(random_whisper), page_size="16", max_running_requests=4,
                     overlap_schedule="on")
    assert not plain.overlap and overlap.overlap
    base = _outputs(plain, _requests())
    # stop each request on a token it produces midway, so requests end at different steps
    stops = [toks[len(toks) // 2] for toks, _, _ in base]
    for reqs in (_requests(), _requests(stops)):
        a, b = _outputs(plain, reqs), _outputs(overlap, [
            GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling) for r in reqs])
        assert [x[:2] for x in a] == [x[:2] for x in b]
        for x, y in zip(a, b, strict=True):
            assert x[2] == pytest.approx(y[2], abs=1e-5)
    assert any(reason.value == "stop" for _, reason, _ in _outputs(plain, _requests(stops)))


def test_overlap_transcription_of_real_speech():
    """Plain and timestamped decoding (every window carries the batched filters)."""
    runs = []
    for mode in ("off", "on"):
        engine = build_engine(max_running_requests=4, overlap_schedule=mode)
        files = [DATA / "jfk.wav", DATA / "cards_005.wav"]
        plain = transcribe(engine, files)
        timed = transcribe(engine, files, options=TranscribeOptions(timestamps=True))
        runs.append(([r.text for r in plain],
                     [[(s.start, s.end, s.tokens) for s in r.segments] for r in timed]))
    assert runs[0] == runs[1]
    assert runs[0][0][0] == TINY_EN_TEXT
    assert all(len(segs) >= 1 for segs in runs[0][1])
