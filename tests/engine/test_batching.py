"""Continuous batching: batch invariance, back-pressure on an exhausted pool, aborts, errors."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine

PROMPT = [50257, 50362]


def _requests(n: int, seed: int = 0) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        mel = torch.randn(80, 3000, generator=gen) * 0.5
        steps = 3 + (5 * i) % 11  # different output lengths
        prompt = PROMPT if i % 2 == 0 else [50257, 50361 + (i % 2), 50362][: 2 + i % 3]
        reqs.append(GenerateRequest(prompt, mel,
                                    SamplingParams(max_new_tokens=steps, ignore_eos=True)))
    return reqs


def _clone(reqs):
    return [GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling) for r in reqs]


@pytest.mark.parametrize("strategy,page_size", [("flat", "1"), ("aligned", "16"),
                                                 ("ragged", "128")])
def test_batch_invariance(random_whisper, strategy, page_size):
    engine = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                    max_running_requests=8)
    reqs = _requests(8)
    together = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in _clone(reqs)]
    for a, b, r in zip(together, alone, reqs, strict=True):
        assert a.finish_reason == FinishReason.LENGTH
        assert len(a.token_ids) == r.sampling.max_new_tokens
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_pool_for_two_requests_still_completes_ten(random_whisper):
    # Each request reserves ceil(1500 + 2 + 8, 16) = 1520 slots; the pool holds two of them.
    engine = build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                    max_running_requests=10, max_total_tokens=2 * 1520 + 16)
    assert engine.pools.allocator.size < 3 * 1520
    reqs = [GenerateRequest(PROMPT, r.encoder_input, SamplingParams(max_new_tokens=8,
                                                                    ignore_eos=True))
            for r in _requests(10)]
    peak = 0
    schedule = engine.scheduler.schedule

    def watched_schedule():
        nonlocal peak
        sched = schedule()
        peak = max(peak, len(engine.scheduler.running))
        return sched

    engine.scheduler.schedule = watched_schedule
    outs = engine.generate(reqs)
    assert peak == 2  # back-pressure: never more than the pool holds
    assert all(o.finish_reason == FinishReason.LENGTH and len(o.token_ids) == 8 for o in outs)
    solo = engine.generate(_clone(reqs[:1]))[0]
    assert outs[0].token_ids == solo.token_ids


def test_pool_smaller_than_one_request_is_a_startup_error(random_whisper):
    from edserve.mem_cache import PoolTooSmallError

    with pytest.raises(PoolTooSmallError, match="fewer than one request needs"):
        build_engine(model=str(random_whisper), page_size="16", max_total_tokens=1600)


def test_abort_frees_kv(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=4)
    reqs = [GenerateRequest(PROMPT, r.encoder_input, SamplingParams(max_new_tokens=50,
                                                                    ignore_eos=True))
            for r in _requests(3)]
    finished = {}
    for r in reqs:
        engine.add_request(r, lambda d: finished.__setitem__(d.rid, d.output)
                           if d.finished else None)
    engine.step()  # prefill: all three admitted
    assert engine.pools.allocator.available_size() < engine.pools.allocator.size
    engine.step()
    engine.abort(reqs[1].rid)
    while engine.has_work():
        engine.step()
    assert finished[reqs[1].rid].finish_reason == FinishReason.ABORT
    assert len(finished[reqs[0].rid].token_ids) == 50


def test_bad_requests_raise_specific_errors(random_whisper):
    engine = build_engine(model=str(random_whisper), max_running_requests=2)
    mel = torch.zeros(80, 3000)
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        engine.add_request(GenerateRequest([], mel))
    with pytest.raises(ValueError, match="log-mel"):
        engine.add_request(GenerateRequest(PROMPT, torch.zeros(80, 100)))
    with pytest.raises(ValueError, match="no room"):
        engine.add_request(GenerateRequest([50257] * 448, mel))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # A good request still runs afterwards.
    [out] = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=3))])
    assert out.error is None


def test_seeded_sampling_is_reproducible(random_whisper):
    engine = build_engine(model=str(random_whisper), max_running_requests=4)
    mel = _requests(1)[0].encoder_input

    def run(seed):
        sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=10, ignore_eos=True)
        return engine.generate([GenerateRequest(PROMPT, mel, sp)])[0].token_ids

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_context_length_bounds_decoder_positions(random_whisper):
    assert build_engine(model=str(random_whisper), max_running_requests=1).max_decoder_len == 448
    engine = build_engine(model=str(random_whisper), max_running_requests=1, context_length=100)
    assert engine.max_decoder_len == 100
    with pytest.raises(ValueError, match="see --context-length"):
        engine.add_request(GenerateRequest([50257] * 100, torch.zeros(80, 3000)))
    [out] = engine.generate([GenerateRequest(PROMPT, torch.zeros(80, 3000),
                                             SamplingParams(max_new_tokens=500, ignore_eos=True))])
    assert len(out.token_ids) == 100 - len(PROMPT)  # stopped by the context, not by the pool
    assert out.finish_reason == FinishReason.LENGTH
