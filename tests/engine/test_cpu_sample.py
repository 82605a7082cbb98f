"""Compiled sampling of compiled CPU decode steps (edserve.engine.cpu_sample): over a step's
padded rows it gives the real rows the eager sampler's tokens, log-probabilities, candidates and
histories, step after step (filters on, beam rows moving, a second key beside the first);
plans it cannot compile are left to the eager sampler. Inductor's C++ code and dynamo's trace
(``backend="eager"``) both."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.cpu_sample import CompiledSampler
from edserve.engine.sampler import CandidatePlan, FilterGroup, SamplingPlan, sample
from edserve.engine.token_history import TokenHistory
from edserve.whisper.logits import ApplyTimestampRules, SuppressBlank, SuppressTokens

V, TS, EOT, NO_TS = 120, 70, 50, 60
CHAIN = (SuppressBlank((EOT, 3)), SuppressTokens((5, 7, 61)),
         ApplyTimestampRules(EOT, NO_TS, TS, 10))
CPU = torch.device("cpu")


def _plan(chain=CHAIN, topk_rows=None, k=3, sampled=None) -> SamplingPlan:
    plan = SamplingPlan([FilterGroup(chain, None, ("a", "b", "c"))] if chain else [], sampled,
                        None if sampled is None else torch.ones(1), None,
                        [] if sampled is None else [None])
    if topk_rows is not None:
        plan.candidates = CandidatePlan([], torch.tensor(topk_rows), k, None, None, None, [])
    return plan


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_sampling_equals_the_eager_sampler_step_after_step(backend, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    rows, prow = torch.tensor([3, 5, 7]), torch.tensor([3, 5, 7, 0, 0, 0, 0, 0])
    sampler = CompiledSampler(backend)
    eager, compiled = TokenHistory(8, 6, CPU), TokenHistory(8, 6, CPU)
    for step in range(8):  # past the histories' length: the full rows' last column
        beams = ([0, 2], [1, 2], [2, 0])[step % 3] if step >= 4 else None  # a second key
        logits = torch.randn(8, V, generator=gen) * 3
        logits[:, TS:] += 2.0 * (step % 2)  # timestamps win every other step
        want = sample(logits[:3].clone(), _plan(topk_rows=beams), eager, rows)
        got = sampler.sample(_plan(topk_rows=beams), logits.clone(), prow, 3, compiled)
        assert torch.equal(got[0], want[0])  # log-probs: inductor sums in its own order
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)
        if beams is None:
            assert got[2] is None and want[2] is None
        else:  # the moving beam rows' top-k, read through the function's static index
            assert torch.equal(got[2][0], want[2][0])
            torch.testing.assert_close(got[2][1], want[2][1], rtol=1e-6, atol=1e-5)
        assert torch.equal(compiled.tokens[1:], eager.tokens[1:])
        assert torch.equal(compiled.lengths[1:], eager.lengths[1:])
        assert int(compiled.lengths[0]) <= 6  # the padding row, listed five times, bounded
    assert bool((eager.tokens[rows, 0] >= TS).all())  # the grammar ran: a timestamp first
    # each key: one eager step (the filters' tensors built), then compiled steps
    assert len(sampler.fns) == 2 and sampler.steps == 8 - 2


def test_plans_it_cannot_compile_are_left_to_the_eager_sampler():
    sampler = CompiledSampler("eager", max_keys=1)
    hist = TokenHistory(8, 6, CPU)
    logits, prow = torch.randn(4, V), torch.tensor([2, 6, 0, 0])
    assert sampler.sample(_plan(sampled=torch.tensor([0])), logits, prow, 2, hist) is None
    assert int(hist.lengths.sum()) == 0  # nothing appended: the caller samples
    for _ in range(3):  # a first key takes the one slot
        sampler.sample(_plan(), logits.clone(), prow, 2, hist)
    ref = TokenHistory(8, 6, CPU)
    ref.tokens.copy_(hist.tokens)
    ref.lengths.copy_(hist.lengths)
    other = _plan(chain=CHAIN[:1])  # a second key past max_keys: eager every step
    for _ in range(2):
        got = sampler.sample(other, logits.clone(), prow, 2, hist)
        want = sample(logits[:2].clone(), other, ref, prow[:2])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(hist.tokens[1:], ref.tokens[1:]) and len(sampler.fns) == 1
    assert sampler.steps == 2
