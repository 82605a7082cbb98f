"""EngineCore: the rules both engine loops share (in-flight registry, a failed step fails
only what was in flight, stats, validate, integrity), on a real engine stepped by hand."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.core import EngineCore
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine


def _request(new_tokens: int, seed: int = 0) -> GenerateRequest:
    g = torch.Generator().manual_seed(seed)
    return GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                           SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


def _drain(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def test_failed_step_fails_each_inflight_request_once_and_the_engine_keeps_serving(
        random_whisper):
    engine = build_engine(model=str(random_whisper))
    core = EngineCore(engine)
    expected = engine.generate([_request(5, seed=7)])[0].token_ids
    finals: dict[str, list] = {}

    def collect(delta) -> None:
        if delta.finished:
            finals.setdefault(delta.rid, []).append(delta.output)

    reqs = [_request(40, seed=i) for i in range(2)]
    for r in reqs:
        core.submit(r, collect, stream=False)
    assert core.num_inflight == 2 and sorted(core.inflight_ids()) == sorted(r.rid for r in reqs)
    assert core.step()
    original = engine.step
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    assert not core.step()
    engine.step = original
    _drain(core)  # the aborts' own finished deltas are dropped: one final per request
    assert sorted(finals) == sorted(r.rid for r in reqs)
    for outs in finals.values():
        assert [(o.finish_reason, o.error) for o in outs] == [
            (FinishReason.ERROR, "engine step failed: RuntimeError: boom")]
    assert core.num_inflight == 0
    report = core.integrity()
    assert report == {"ok": True, "kv_slots_used": 0, "kv_slots_total": core.stats().kv_total,
                      "running": 0, "waiting": 0, "inflight": 0}

    after = _request(5, seed=7)
    core.submit(after, collect, stream=True)
    _drain(core)
    assert finals[after.rid][0].token_ids == expected


def test_stats_validate_and_refused_submit(random_whisper):
    engine = build_engine(model=str(random_whisper))
    core = EngineCore(engine)
    s = core.stats()
    assert s.kv_total == engine.pools.allocator.size and s.kv_used == 0 and s.running == 0
    too_long = GenerateRequest([50257] * 500, torch.zeros(80, 3000))
    with pytest.raises(ValueError, match="prompt of 500 tokens"):
        core.validate(too_long)
    with pytest.raises(ValueError):
        core.submit(too_long, lambda d: None, stream=False)
    assert core.num_inflight == 0  # a refused request is not registered
    core.validate(_request(5))
    core.submit(_request(5), lambda d: None, stream=False)
    core.step()
    assert core.stats().running == 1 and core.stats().kv_used > 0
    _drain(core)
    assert core.stats().generated_tokens == 5 and core.num_inflight == 0
