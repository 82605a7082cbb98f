"""Prefill prompts through the decode graphs (:mod:`edserve.engine.prompt_graphs`), on the CPU.

A CUDA graph replays :func:`~edserve.engine.graph_inputs.static_forward` on the static inputs;
here the same :class:`PromptReplayer` runs that function eagerly instead of replaying a graph,
so the CPU proves what the graph path computes: logits (and no-speech probabilities) equal to
the eager extend pass for prompts of different lengths, and the same outputs end to end for
every strategy and page size, with the KV integrity check passing after every step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edserve.engine.cuda_graph import capture_sizes
from edserve.engine.graph_inputs import GraphInputs, static_forward
from edserve.engine.prompt_graphs import PromptReplayer
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine

SOT, NO_SPEECH = 50257, 50361
PROMPTS = [[SOT], [SOT, 50362], [SOT, 50259, 50362], [SOT, 50259, 50359, 50362],
           [50360, 400, 401, SOT, 50362]]  # the last: a text prompt before the SOT
MAX_BS = 6


def _replayer(engine, max_tokens: int = 8) -> PromptReplayer:
    """The replayer a DecodeGraphRunner builds, with graph replays replaced by eager runs of
    the function the graphs capture."""
    pools = engine.pools
    inputs = GraphInputs(MAX_BS, engine.device, ranged=False,
                         grouped=pools.backend.grouped_cross)
    return PromptReplayer(inputs, capture_sizes(MAX_BS),
                          lambda padded: static_forward(engine.model, pools, inputs, padded),
                          max_tokens)


def _requests(n: int, seed: int = 3) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        sp = SamplingParams(max_new_tokens=3 + i % 4, ignore_eos=True) if i != 2 \
            else SamplingParams(temperature=0.7, seed=5, max_new_tokens=5, ignore_eos=True)
        out.append(GenerateRequest(prompt, torch.randn(80, 3000, generator=gen) * 0.5, sp,
                                   no_speech_pos=prompt.index(SOT), no_speech_token=NO_SPEECH))
    return out


def _submit(engine, reqs, outs: dict) -> None:
    for r in reqs:
        engine.add_request(GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling, rid=r.rid,
                                           no_speech_pos=r.no_speech_pos,
                                           no_speech_token=r.no_speech_token),
                           lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None,
                           stream=False)


def _run(engine, reqs, stagger: bool = False) -> dict:
    """Outputs by rid; ``stagger``: the second half arrives while the first decodes (mixed
    steps), else all at once. Integrity after every step."""
    outs = {}
    half = len(reqs) // 2 if stagger else len(reqs)
    _submit(engine, reqs[:half], outs)
    steps = 0
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps == 2 and half < len(reqs):
            _submit(engine, reqs[half:], outs)
    if half < len(reqs) and steps < 2:
        raise AssertionError("the first requests finished before the others arrived")
    return outs


@pytest.mark.parametrize("strategy,page_size", [("flat", "1"), ("flat", "128"),
                                                ("aligned", "16"), ("aligned", "128")])
def test_prompt_replays_give_the_eager_outputs(random_whisper, strategy, page_size):
    reqs = _requests(7)  # 7 > MAX_BS: the first prefill batch is too large and runs eagerly
    late = _requests(6, seed=9)[:4]  # two arrive while two decode: mixed steps
    results, seen = {}, {"plain": 0, "mixed": 0, "eager": 0}
    for graphs in (False, True):
        engine = build_engine(model=str(random_whisper), page_size=page_size, dtype="float32",
                              encoder_kv=strategy, max_running_requests=8, mixed_steps=True)
        if graphs:
            replayer = _replayer(engine, max_tokens=4)  # the 5-token prompt stays eager
            run = engine.runner.run

            def watched(sched, run=run, replayer=replayer):
                if sched.mode == ForwardMode.EXTEND:
                    ok = replayer.accepts(sched.batch)
                    seen["eager" if not ok else "mixed" if sched.num_decode else "plain"] += 1
                return run(sched)

            engine.runner.run = watched
            engine.runner.graph_runner = SimpleNamespace(prompts=replayer,
                                                         can_run=lambda batch, plan=None: False)
        results[graphs] = _run(engine, reqs[:3]) | _run(engine, reqs[3:]) \
            | _run(engine, late, stagger=True)
    assert seen["plain"] >= 1 and seen["eager"] >= 1 and seen["mixed"] >= 1, seen
    assert results[True].keys() == results[False].keys()
    for rid, b in results[False].items():
        a = results[True][rid]
        assert a.error is None and a.token_ids == b.token_ids and len(a.token_ids) > 0
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.no_speech_prob is not None
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-5)


@pytest.mark.parametrize("strategy,page_size", [("flat", "16"), ("aligned", "128")])
def test_replayed_logits_equal_the_extend_pass(random_whisper, strategy, page_size):
    """One prefill batch, prompts of 1 to 4 tokens: the replays' last-token logits and picked
    positions equal the eager extend pass's (fp32)."""
    engine = build_engine(model=str(random_whisper), page_size=page_size, dtype="float32",
                          encoder_kv=strategy, max_running_requests=8, mixed_steps=False)
    replayer = _replayer(engine)
    runner, seen = engine.runner, {}
    run = runner.run

    def compare(sched):
        if sched.mode == ForwardMode.EXTEND and "logits" not in seen:
            batch = sched.batch
            assert replayer.accepts(batch)
            with torch.inference_mode():
                states = runner._encode(list(sched.reqs))
                batch.attn_backend.init_forward_metadata(batch)
                hidden = engine.model(sched.prompt_ids, batch.positions, batch, states)
                last = batch.cu_q[1:].long() - 1
                eager = engine.model.compute_logits(hidden[last])
                picks = [(i, len(r.request.prompt_ids) - 1) for i, r in enumerate(sched.reqs)]
                first = [(i, 0) for i in range(batch.batch_size)]
                out = replayer.run(batch, sched.prompt_ids, picks + first)
                starts = batch.q_starts_cpu
                at_first = engine.model.compute_logits(hidden[torch.tensor(starts)])
            seen["logits"] = (out, eager, at_first, len(picks))
            # the pool now holds this step's K/V: the real step writes the same values again
            for r in sched.reqs:  # re-encode in the real step
                r.encoder_input = r.request.encoder_input
        return run(sched)

    runner.run = compare
    _run(engine, _requests(4))
    out, eager, at_first, n = seen["logits"]
    torch.testing.assert_close(out.logits, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.picked[:n], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.picked[n:], at_first, rtol=1e-5, atol=1e-5)


def test_the_replayer_refuses_what_it_cannot_run(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="16", dtype="float32",
                          encoder_kv="flat", max_running_requests=8)
    replayer = _replayer(engine, max_tokens=2)
    off = PromptReplayer(replayer.inputs, replayer.sizes, replayer.run_static, 0)
    decisions = []
    run = engine.runner.run

    def record(sched):
        b = sched.batch
        decisions.append((b.mode.name, b.max_q, replayer.accepts(b), off.accepts(b)))
        return run(sched)

    engine.runner.run = record
    reqs = _requests(4)
    _run(engine, reqs[:1])  # a 1-token prompt: replayed; its decode steps are not prompts
    _run(engine, reqs[2:3])  # 3 tokens > max_tokens: eager
    assert decisions[0] == ("EXTEND", 1, True, False)
    assert decisions[1][:1] == ("DECODE",) and not any(d[2] for d in decisions[1:3])
    assert ("EXTEND", 3, False, False) in decisions


def test_prompt_tokens_share_replays(random_whisper):
    """Every prompt token is a graph row: a 4-token prompt is one replay, and a batch takes
    ceil(prompt tokens / largest graph) replays, its logits still the eager pass's."""
    engine = build_engine(model=str(random_whisper), page_size="16", dtype="float32",
                          encoder_kv="flat", max_running_requests=8, mixed_steps=False)
    base = _replayer(engine)
    sizes = []

    def counted(padded: int) -> torch.Tensor:
        sizes.append(padded)
        return base.run_static(padded)

    replayer = PromptReplayer(base.inputs, base.sizes, counted, 8)
    runner, seen = engine.runner, []
    run = runner.run

    def compare(sched):
        if sched.mode == ForwardMode.EXTEND:
            batch = sched.batch
            with torch.inference_mode():
                states = runner._encode(list(sched.reqs))
                batch.attn_backend.init_forward_metadata(batch)
                hidden = engine.model(sched.prompt_ids, batch.positions, batch, states)
                eager = engine.model.compute_logits(hidden[batch.cu_q[1:].long() - 1])
                sizes.clear()
                out = replayer.run(batch, sched.prompt_ids)
            seen.append((batch.num_tokens, list(sizes), out.logits, eager))
            for r in sched.reqs:  # re-encode in the real step
                r.encoder_input = r.request.encoder_input
        return run(sched)

    runner.run = compare
    reqs = _requests(5)
    _run(engine, [reqs[3]])  # one 4-token prompt
    _run(engine, reqs[1:5])  # 2 + 3 + 4 + 5 = 14 tokens, largest graph 6: 3 replays
    assert [(n, s) for n, s, _, _ in seen] == [(4, [4]), (14, [6, 6, 2])]
    for _, _, got, eager in seen:
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
