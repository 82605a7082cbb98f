"""Mixed steps (chunked prefill for encoder-decoder): requests arriving while others decode give
the same outputs with ``mixed_steps`` on and off, for every strategy and page size, with greedy,
seeded sampling and beam rows; the KV integrity check passes after every step."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine

PROMPT = [50257, 50362]


def _requests(n: int, seed: int = 5) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        mel = torch.randn(80, 3000, generator=gen) * 0.5
        if i == 3:  # a seeded sampled row: its draws must not depend on its batch-mates
            sp = SamplingParams(temperature=0.8, seed=11, max_new_tokens=9, ignore_eos=True)
        elif i == 4:  # a beam group: its rows fork and drop while others arrive
            sp = SamplingParams(beam_size=2, max_new_tokens=6)
        else:
            sp = SamplingParams(max_new_tokens=4 + (3 * i) % 7, ignore_eos=True)
        reqs.append(GenerateRequest(PROMPT[: 1 + i % 2] + PROMPT[1:], mel, sp,
                                    no_speech_pos=0, no_speech_token=50361))
    return reqs


def _run_staggered(engine: Engine, reqs: list[GenerateRequest]) -> tuple[dict, int]:
    """Submit 2, step 3 times, submit 3, step twice, submit the rest; integrity after every
    step. Returns the outputs by rid and the number of mixed steps (prefill + decode rows)."""
    outs, mixed = {}, 0
    schedule = engine.scheduler.schedule

    def watched():
        nonlocal mixed
        sched = schedule()
        if sched is not None and sched.mode == ForwardMode.EXTEND and sched.num_decode:
            mixed += 1
        return sched

    engine.scheduler.schedule = watched

    def submit(batch):
        for r in batch:
            engine.add_request(GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling,
                                               rid=r.rid, no_speech_pos=r.no_speech_pos,
                                               no_speech_token=r.no_speech_token),
                               lambda d: outs.__setitem__(d.rid, d.output)
                               if d.finished else None, stream=False)

    for batch, steps in ((reqs[:2], 3), (reqs[2:5], 2), (reqs[5:], None)):
        submit(batch)
        n = 0
        while engine.has_work() and (steps is None or n < steps):
            engine.step()
            engine.check_integrity()
            n += 1
    return outs, mixed


@pytest.mark.parametrize("strategy", ["aligned", "flat", "ragged"])
@pytest.mark.parametrize("page_size", ["1", "16", "128"])
def test_mixed_steps_give_the_same_outputs(random_whisper, strategy, page_size):
    reqs = _requests(7)
    results = {}
    for mixed in (True, False):
        engine = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                        max_running_requests=8, mixed_steps=mixed, overlap_schedule="on")
        results[mixed] = _run_staggered(engine, reqs)
    (on, n_on), (off, n_off) = results[True], results[False]
    assert n_on >= 2 and n_off == 0  # arrivals did prefill next to decoding rows
    for r in reqs:
        a, b = on[r.rid], off[r.rid]
        assert a.error is None and a.finish_reason == b.finish_reason
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-5)
        assert a.no_speech_prob is not None


def test_a_failed_mixed_step_fails_its_rows_and_frees_them(random_whisper, monkeypatch):
    """The encoder raising in a mixed step fails the arrivals and the rows decoding with them
    (they were advanced for the step); their KV is freed and the engine goes on."""
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=4)
    reqs = _requests(4)
    outs = {}

    def submit(r):
        engine.add_request(GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling,
                                           rid=r.rid),
                           lambda d: outs.__setitem__(d.rid, d.output)
                           if d.finished else None)

    submit(reqs[0])
    engine.step()  # prefill alone
    encode = engine.model.encode
    monkeypatch.setattr(engine.model, "encode",
                        lambda inputs: (_ for _ in ()).throw(RuntimeError("encoder down")))
    submit(reqs[1])
    engine.step()  # mixed: reqs[0] decodes next to reqs[1]'s failing prefill
    assert {rid: o.error for rid, o in outs.items()} == {
        reqs[0].rid: "RuntimeError: encoder down", reqs[1].rid: "RuntimeError: encoder down"}
    monkeypatch.setattr(engine.model, "encode", encode)
    submit(reqs[2])
    while engine.has_work():
        engine.step()
    assert outs[reqs[2].rid].error is None and len(outs[reqs[2].rid].token_ids) > 0
