"""Sampling inside compiled CPU decode graphs (edserve.engine.cpu_sample): which plans a graph
samples with and the kept plan it reads; that ``sample`` compiled by inductor over a graph's
padded rows gives the real rows the eager sampler's tokens, log-probabilities, candidates and
histories step after step; and in the engine, two filter chains in turn (transcription with and
without timestamps) each land on their own graph under the unsafe guard stance, text equal to
the eager path's."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import CLIPS, DATA

from edserve.audio.decode import load_audio
from edserve.engine.cpu_compile import CompiledDecodeRunner
from edserve.engine.cpu_sample import SamplingKeys
from edserve.engine.sampler import CandidatePlan, FilterGroup, SamplingPlan, sample
from edserve.engine.token_history import TokenHistory
from edserve.runtime import build_engine
from edserve.whisper.logits import ApplyTimestampRules, SuppressBlank, SuppressTokens
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

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


def test_a_key_runs_eagerly_once_then_samples_through_its_kept_plan():
    keys = SamplingKeys(max_keys=2)
    temperature = _plan(sampled=torch.tensor([0]))
    assert not keys.first_step(temperature, 4) and keys.plan_for(temperature, 4) is None
    assert keys.plan_for(_plan(), 4) is None  # before its first step: not in a graph
    assert keys.first_step(_plan(), 4) and not keys.first_step(_plan(), 4)  # once
    key, kept = keys.plan_for(_plan(), 4)
    assert key == (4, CHAIN, ()) and keys.plan_for(_plan(), 4) == (key, kept)  # kept: same
    assert keys.first_step(_plan(topk_rows=[0, 2]), 4)
    key2, beams = keys.plan_for(_plan(topk_rows=[2, 1]), 4)
    assert key2 == (4, CHAIN, (2, 3)) and beams.candidates.topk_rows.tolist() == [2, 1]
    moved = _plan(topk_rows=[1, 0])
    assert keys.plan_for(moved, 4)[1] is beams  # the static index takes this step's rows
    assert beams.candidates.topk_rows.tolist() == [1, 0]
    assert beams.candidates.topk_rows is not moved.candidates.topk_rows
    for _ in range(2):  # past max_keys: a new key samples eagerly (after a logits graph)
        assert not keys.first_step(_plan(chain=CHAIN[:1]), 4)
        assert keys.plan_for(_plan(chain=CHAIN[:1]), 4) is None
    assert len(keys.plans) == 2


def test_inductor_compiled_sampling_over_padded_rows_equals_the_eager_sampler(tmp_path,
                                                                             monkeypatch):
    """What a compiled decode graph does after its logits (inductor's C++ code): ``sample``
    over all padded rows, the padding rows at history row 0, the kept plan's static top-k
    index; the real rows' tokens, candidates and histories equal eager ones."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    rows, prow = torch.tensor([3, 5, 7]), torch.tensor([3, 5, 7, 0, 0, 0, 0, 0])
    keys, fns = SamplingKeys(), {}
    eager, compiled = TokenHistory(8, 6, CPU), TokenHistory(8, 6, CPU)
    for step in range(9):  # past the histories' length: the full rows' last column
        beams = ([0, 2], [1, 2], [2, 0])[step % 3] if step >= 4 else None  # a second key
        logits = torch.randn(8, V, generator=gen) * 3
        logits[:, TS:] += 2.0 * (step % 2)  # timestamps win every other step
        want = sample(logits[:3].clone(), _plan(topk_rows=beams), eager, rows)
        found = None if keys.first_step(_plan(topk_rows=beams), 8) \
            else keys.plan_for(_plan(topk_rows=beams), 8)
        if found is None:
            got = sample(logits[:3].clone(), _plan(topk_rows=beams), compiled, rows)
        else:
            key, kept = found
            fn = fns.setdefault(key, torch.compile(sample, backend="inductor", dynamic=False))
            t, lp, c = fn(logits.clone(), kept, compiled, prow)
            got = (t[:3], lp[:3], c)
        assert torch.equal(got[0], want[0])  # log-probs: inductor sums in its own order
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)
        if beams is None:
            assert got[2] is None and want[2] is None
        else:  # the moving beam rows' top-k, read through the kept plan's static index
            assert torch.equal(got[2][0], want[2][0])
            torch.testing.assert_close(got[2][1], want[2][1], rtol=1e-6, atol=1e-5)
        assert torch.equal(compiled.tokens[1:], eager.tokens[1:])
        assert torch.equal(compiled.lengths[1:], eager.lengths[1:])
        assert int(compiled.lengths[0]) <= 6  # the padding row, listed five times, bounded
    assert bool((eager.tokens[rows, 0] >= TS).all())  # the grammar ran: a timestamp first
    assert len(fns) == 2


@pytest.fixture(scope="module")
def eager_engine(random_whisper):
    return build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                        cpu_compile="off")


def test_two_filter_chains_in_turn_each_sample_in_their_own_graph(random_whisper,
                                                                   eager_engine):
    """Transcription with and without timestamps (two filter chains: two sampling keys of the
    one-row bucket) in turn, traced graphs called under the unsafe guard stance: every text
    equals the eager path's, and the steps were sampled inside the graphs."""
    traced = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                          cpu_compile="off")
    runner = traced.runner.graph_runner = CompiledDecodeRunner(
        traced.model, traced.pools, 2, traced.model.max_encoder_len, traced.max_decoder_len, 0,
        None, backend="eager")
    audio = load_audio(DATA / f"{CLIPS[0]}.wav")
    for timestamps in (False, True, False, True):
        opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=timestamps,
                                 beam_size=1, max_new_tokens=16)
        want = transcribe(eager_engine, [audio], options=opts)[0]
        got = transcribe(traced, [audio], options=opts)[0]
        assert got.text == want.text and [(s.start, s.end) for s in got.segments] == \
            [(s.start, s.end) for s in want.segments]
    sampled = {k[3] for k in runner.graphs if k[3] is not None}
    assert len(sampled) == 2 and runner.sampled_steps >= 2 * 10
    # each key's first step ran eagerly: no graph without sampling was made for one step
    assert all(k[3] is not None for k in runner.graphs)
