"""Prefill prompts through the captured decode graphs on the GPU (H200): the same outputs as the
eager prefill pass (fp32, so that kernel rounding cannot flip a token), every strategy that
captures graphs, page sizes 1/16/128, prompts of 1 to 5 tokens (5: over the limit, eager),
plain and mixed prefill steps."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from edserve.runtime import build_engine
from tests.engine.test_prompt_graphs import _requests, _run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _outputs(random_whisper, strategy, page_size, reqs, late, max_tokens):
    """(outputs by rid, prompt replay calls, a weak reference to the engine) of one engine."""
    engine = build_engine(model=str(random_whisper), device="cuda", dtype="float32",
                          page_size=page_size, encoder_kv=strategy, max_running_requests=8,
                          prompt_cuda_graph_max_tokens=max_tokens,
                          max_total_tokens=65536)  # leave the GPU to the other tests
    prompts = engine.runner.graph_runner.prompts
    assert (prompts is not None) == (max_tokens > 0)
    calls = []
    if prompts is not None:
        run = prompts.run
        prompts.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    outs = _run(engine, reqs[:3]) | _run(engine, reqs[3:]) | _run(engine, late, stagger=True)
    if prompts is not None:
        del prompts.run  # the counter's closure (a cycle through prompts)
    return outs, len(calls), weakref.ref(engine)


@pytest.mark.parametrize("strategy,page_size", [("flat", "1"), ("flat", "128"),
                                                ("aligned", "16"), ("aligned", "128")])
def test_prompt_graph_replays_match_the_eager_prefill(random_whisper, strategy, page_size):
    reqs, late = _requests(9), _requests(6, seed=9)[:4]  # late: mixed steps
    results, used = {}, {}
    for max_tokens in (4, 0):
        results[max_tokens], used[max_tokens], ref = _outputs(random_whisper, strategy,
                                                              page_size, reqs, late, max_tokens)
        # freed by reference counting alone (a cycle would keep its KV pool allocated until a
        # gc pass: the next engine, sized from free memory, would find none)
        assert ref() is None
        gc.collect()
        torch.cuda.empty_cache()
    # replayed: the first batch and the late arrivals' steps (the second has a 5-token prompt)
    assert used[4] >= 2 and used[0] == 0
    for r in reqs + late:
        a, b = results[4][r.rid], results[0][r.rid]
        assert a.error is None and a.token_ids == b.token_ids and len(a.token_ids) > 0
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-4)
