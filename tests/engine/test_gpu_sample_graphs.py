"""Sampling graphs on the GPU (H200): steps whose sampling replays a captured graph give the
tokens and log-probabilities of eager sampling (fp32, random-weight Whisper, openai-whisper's
filters with the timestamp grammar), at batch sizes that pad their decode graph, under flat and
aligned at page sizes 1 and 128; batches a graph cannot take (two filter chains, a sampled row)
stay eager and equal too."""

from __future__ import annotations

import gc

import pytest
import torch

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _requests(tok, mixed: bool) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(7)
    full = [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok)),
            ApplyTimestampRules.of(tok)]
    out = []
    for i in range(5):  # 5 rows: the decode graph of 8 pads 3
        chain = full if not mixed or i % 2 else full[:2]
        sp = SamplingParams(max_new_tokens=10 + i, ignore_eos=True)
        if mixed and i == 4:
            sp = SamplingParams(temperature=0.8, seed=11, max_new_tokens=10, ignore_eos=True)
        out.append(GenerateRequest([tok.sot], torch.randn(80, 3000, generator=gen) * 0.5, sp,
                                   logits_processors=list(chain)))
    return out


def _run(random_whisper, strategy, page_size, on: bool, mixed: bool):
    engine = build_engine(model=str(random_whisper), device="cuda", dtype="float32",
                          page_size=page_size, encoder_kv=strategy, max_running_requests=8,
                          sampling_cuda_graph=on, max_total_tokens=65536)
    outs = engine.generate(_requests(engine.tokenizer, mixed))
    engine.check_integrity()
    sampling = engine.runner.graph_runner.sampling
    replays = 0 if sampling is None else sampling.replays
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return [(o.error, o.token_ids, o.logprobs) for o in outs], replays


@pytest.mark.parametrize("strategy,page_size", [("flat", "1"), ("flat", "128"),
                                                ("aligned", "128")])
@pytest.mark.parametrize("mixed", [False, True])
def test_sampling_graphs_give_the_eager_tokens(random_whisper, strategy, page_size, mixed):
    on, replays = _run(random_whisper, strategy, page_size, True, mixed)
    off, none = _run(random_whisper, strategy, page_size, False, mixed)
    assert none == 0
    # one chain, all greedy: every steady step replays; mixed chains or a sampled row: eager
    assert (replays > 0) != mixed, replays
    for (err, toks, lps), (err0, toks0, lps0) in zip(on, off, strict=True):
        assert err is None and err0 is None
        assert toks == toks0 and len(toks) >= 10
        assert lps == pytest.approx(lps0, abs=1e-5)
