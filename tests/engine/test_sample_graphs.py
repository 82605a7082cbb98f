"""Sampling graphs (edserve.engine.sample_graphs) on the CPU: which plans a graph may capture,
and that the captured function, run over a graph's padded rows (the padding rows all point at
the token history's row 0), gives the real rows the eager sampler's tokens, log-probabilities
and histories. The capture and replay themselves run on CUDA
(tests/engine/test_gpu_sample_graphs.py)."""

from __future__ import annotations

import torch

from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.sample_graphs import SampleGraphs, candidate_key, graph_key
from edserve.engine.sampler import CandidatePlan, FilterGroup, SamplingPlan, sample
from edserve.engine.token_history import TokenHistory
from edserve.whisper.logits import ApplyTimestampRules, SuppressBlank, SuppressTokens

V, TS, EOT, NO_TS = 120, 70, 50, 60
CHAIN = (SuppressBlank((EOT, 3)), SuppressTokens((5, 7, 61)),
         ApplyTimestampRules(EOT, NO_TS, TS, 10))


def _plan(groups, sampled=None) -> SamplingPlan:
    return SamplingPlan(groups, sampled, None if sampled is None else torch.ones(1), None,
                        [] if sampled is None else [None])


def test_only_greedy_single_chain_capturable_plans_get_a_graph_key():
    whole = FilterGroup(CHAIN, None, ("a", "b"))
    assert graph_key(_plan([whole])) == CHAIN
    assert graph_key(_plan([])) == ()
    assert graph_key(_plan([whole], sampled=torch.tensor([0]))) is None  # temperature
    part = FilterGroup(CHAIN, torch.tensor([0]), ("a",))
    other = FilterGroup(CHAIN[:1], torch.tensor([1]), ("b",))
    assert graph_key(_plan([part, other])) is None  # two chains in one batch
    rec = FilterGroup((LogitsRecorder(),), None, ("a", "b"))
    assert graph_key(_plan([rec])) is None  # host-side effect: stays eager
    beams = _plan([whole])  # beam groups' top-k: capturable, keyed by (rows, k)
    beams.candidates = _cands(torch.tensor([0, 1]), 4)
    assert graph_key(beams) == CHAIN and candidate_key(beams) == (2, 4)
    draws = _plan([whole])  # best_of's seeded draws stay eager
    draws.candidates = _cands(None, 0, draw_rows=torch.tensor([1]))
    assert graph_key(draws) is None and candidate_key(draws) is None
    assert candidate_key(_plan([whole])) == ()


def _cands(topk_rows, k, draw_rows=None) -> CandidatePlan:
    return CandidatePlan([], topk_rows, k, draw_rows, None if draw_rows is None else
                         torch.ones(len(draw_rows)), None,
                         [] if draw_rows is None else [None] * len(draw_rows))


def test_padded_rows_give_the_eager_top_k_candidates():
    """What a sampling graph with beam rows captures: sample() over the padded rows with the
    top-k rows' positions in a separate index tensor (the graph's static copy) returns the
    eager sampler's candidates, tokens and log-probabilities for the real rows."""
    gen = torch.Generator().manual_seed(2)
    rows, prow = torch.tensor([3, 5, 7]), torch.tensor([3, 5, 7, 0, 0, 0])
    eager, padded = TokenHistory(8, 6, torch.device("cpu")), TokenHistory(8, 6,
                                                                         torch.device("cpu"))
    for topk_rows in ([0, 2], [1, 2], [2, 0]):  # the beam rows move between steps
        plan = _plan([FilterGroup(CHAIN, None, ("a", "b", "c"))])
        plan.candidates = _cands(torch.tensor(topk_rows), 3)
        static = plan.candidates.topk_rows.clone()  # what the graph reads
        logits = torch.randn(6, V, generator=gen) * 3
        t_e, lp_e, (ct_e, cl_e) = sample(logits[:3].clone(), plan, eager, rows)
        plan.candidates.topk_rows = static
        t_p, lp_p, (ct_p, cl_p) = sample(logits.clone(), plan, padded, prow)
        assert torch.equal(t_p[:3], t_e) and torch.equal(lp_p[:3], lp_e)
        assert torch.equal(ct_p, ct_e) and torch.equal(cl_p, cl_e)
        assert ct_e.numel() == 2 * 3


def test_padded_rows_sample_like_the_eager_rows_and_keep_row_zero_bounded():
    gen = torch.Generator().manual_seed(0)
    max_tokens, rows = 6, torch.tensor([3, 5, 7])
    eager, padded = TokenHistory(8, max_tokens, torch.device("cpu")), \
        TokenHistory(8, max_tokens, torch.device("cpu"))
    prow = torch.tensor([3, 5, 7, 0, 0, 0, 0, 0])  # a graph of 8 rows for 3 real ones
    plan = _plan([FilterGroup(CHAIN, None, ("a", "b", "c"))])
    for step in range(max_tokens + 3):  # past max_tokens: the full rows' last column
        logits = torch.randn(8, V, generator=gen) * 3
        logits[:, TS:] += 2.0 * (step % 2)  # timestamps win every other step
        t_e, lp_e, _ = sample(logits[:3].clone(), plan, eager, rows)
        t_p, lp_p, _ = sample(logits.clone(), plan, padded, prow)
        assert torch.equal(t_p[:3], t_e) and torch.equal(lp_p[:3], lp_e)
        assert torch.equal(padded.tokens[1:], eager.tokens[1:])
        assert torch.equal(padded.lengths[1:], eager.lengths[1:])
        assert int(padded.lengths[0]) <= max_tokens  # listed 5 times a step, still bounded
    assert eager.lengths[rows].tolist() == [max_tokens] * 3
    assert bool((eager.tokens[rows, 0] >= TS).all())  # the grammar: a timestamp first


def test_past_its_graph_budget_a_new_key_is_sampled_eagerly():
    """No capture (which needs CUDA) once ``max_graphs`` graphs exist: the eager sampler's
    result for the real rows, the history appended once."""
    gen = torch.Generator().manual_seed(1)
    graphs = SampleGraphs(torch.device("cpu"), max_graphs=0)
    hist, ref = TokenHistory(8, 6, torch.device("cpu")), TokenHistory(8, 6, torch.device("cpu"))
    plan = _plan([FilterGroup(CHAIN, None, ("a", "b"))])
    logits = torch.randn(4, V, generator=gen)
    prow = torch.tensor([2, 6, 0, 0])
    tokens, logprobs, cands = graphs.sample(plan, logits.clone(), prow, 2, hist)
    t_ref, lp_ref, _ = sample(logits[:2].clone(), plan, ref, prow[:2])
    assert cands is None and torch.equal(tokens, t_ref) and torch.equal(logprobs, lp_ref)
    assert torch.equal(hist.tokens, ref.tokens) and torch.equal(hist.lengths, ref.lengths)
    assert graphs.graphs == {} and graphs.replays == 0
    sampled = _plan([FilterGroup(CHAIN, None, ("a", "b"))], sampled=torch.tensor([0]))
    assert graphs.sample(sampled, logits, prow, 2, hist) is None  # not capturable at all


def test_the_fused_logits_kernel_gives_the_torch_sampler_results(monkeypatch):
    """The CUDA path for top-k rows (one Triton read of the logits: argmax, logsumexp, top-k;
    the Triton interpreter here) against torch's ops: the same tokens and candidate ids,
    log-probabilities within float32 rounding, padded rows and moving beam rows included."""
    import edserve.engine.sampler as sampler

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: interpreter
    gen = torch.Generator().manual_seed(5)
    prow = torch.tensor([3, 5, 7, 0, 0, 0], device=dev)  # three real rows padded to six
    for topk_rows in ([0, 2], [1, 2], [2, 0, 1]):
        plan = _plan([FilterGroup(CHAIN, None, ("a", "b", "c"))])
        plan.candidates = _cands(torch.tensor(topk_rows, device=dev), 3)
        logits = (torch.randn(6, V, generator=gen) * 3).to(dev)
        got = {}
        for fused in (False, True):
            monkeypatch.setattr(sampler, "_on_triton", lambda t, fused=fused: fused)
            got[fused] = sample(logits.clone(), plan, TokenHistory(8, 6, dev), prow)
        (t0, lp0, (ct0, cl0)), (t1, lp1, (ct1, cl1)) = got[False], got[True]
        assert torch.equal(t0, t1) and torch.equal(ct0, ct1)
        torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(cl1, cl0, rtol=1e-6, atol=1e-5)
        assert ct1.numel() == len(topk_rows) * 3


def test_the_fused_logits_kernel_gives_the_torch_greedy_results(monkeypatch):
    """Greedy rows (no top-k, no candidates) on the CUDA path read the logits once too
    (argmax and logsumexp from the kernel; the interpreter here): the same tokens, log-probs
    within float32 rounding, ties to the first index as torch's argmax, filters applied first."""
    import edserve.engine.sampler as sampler

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: interpreter
    gen = torch.Generator().manual_seed(6)
    prow = torch.tensor([3, 5, 7, 0], device=dev)
    plan = _plan([FilterGroup(CHAIN, None, ("a", "b", "c", "d"))])
    assert plan.candidates is None
    logits = (torch.randn(4, V, generator=gen) * 3).to(dev)
    logits[1, TS + 3] = logits[1, TS + 6] = logits[1].max() + 1  # a tie: the first wins
    # (the first position allows timestamps TS .. TS + 10 only)
    got, calls = {}, []
    stats = __import__("edserve.kernels.logit_stats", fromlist=["x"]).logit_stats
    monkeypatch.setattr("edserve.kernels.logit_stats.logit_stats",
                        lambda *a, **k: calls.append(a) or stats(*a, **k))
    for fused in (False, True):
        monkeypatch.setattr(sampler, "_on_triton", lambda t, fused=fused: fused)
        got[fused] = sample(logits.clone(), plan, TokenHistory(8, 6, dev), prow)
    (t0, lp0, c0), (t1, lp1, c1) = got[False], got[True]
    assert len(calls) == 1 and c0 is None and c1 is None
    assert torch.equal(t0, t1) and int(t1[1]) == TS + 3
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-5)
