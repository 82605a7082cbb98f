"""GPU: CUDA-graph decode equals eager decode for Mllama batches that mix image and text-only rows,
and a steady decode step of such a batch waits on the device at most once.

The tiny random Mllama in fp32 on CUDA with the Triton kernels, one engine with graphs and one
without, same requests (1-, 2- and 4-tile images, two images split by text, text-only rows):
every decode step must replay a graph (mixed batches included), and the logits of every step
must equal the eager engine's. Page sizes 1/16/128 for flat, 16/128 for aligned (the paged
Triton kernel has no page size 1).
"""

from __future__ import annotations

import pytest
import torch
from cuda_syncs import count_syncs

from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import SamplingParams
from edserve.runtime import build_engine
from tests.models.mllama.hf_tiny import save_word_tokenizer
from tests.models.mllama.test_graph_inputs import mixed_cases

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 8


def _run(folder, strategy, page_size, graph):
    eng = build_engine(model=str(folder), device="cuda", dtype="float32", encoder_kv=strategy,
                       page_size=str(page_size), attention_backend="triton", cuda_graph=graph,
                       cuda_graph_max_bs=8, context_length=64, max_total_tokens=8192,
                       max_running_requests=8)
    replays = []
    if graph:
        runner = eng.runner.graph_runner
        replay = runner.replay

        def counted(batch, input_ids):
            replays.append(bool((batch.encoder_lens == 0).any() and
                                (batch.encoder_lens > 0).any()))
            return replay(batch, input_ids)

        runner.replay = counted
    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    recs = [LogitsRecorder() for _ in mixed_cases()]
    reqs = []
    for (prompt, images), rec in zip(mixed_cases(), recs, strict=True):
        r = make_mllama_request(eng.model, prompt, images, sp)
        r.logits_processors.append(rec)
        reqs.append(r)
    outs = eng.generate(reqs)
    eng.check_integrity()
    logits = [torch.stack([x.float().cpu() for x in r.rows]) for r in recs]  # [STEPS, V] each
    return [o.token_ids for o in outs], logits, replays


@pytest.mark.parametrize("strategy,page_size", [("flat", 1), ("flat", 16), ("flat", 128),
                                                 ("aligned", 16), ("aligned", 128)])
def test_graph_equals_eager_for_mixed_batches(tiny_folder, strategy, page_size):
    folder = save_word_tokenizer(tiny_folder)
    eager_tokens, eager_logits, _ = _run(folder, strategy, page_size, graph=False)
    tokens, logits, replays = _run(folder, strategy, page_size, graph=True)
    assert sum(replays) >= STEPS - 1  # the decode steps of the mixed batch replay graphs
    assert tokens == eager_tokens
    for got, want in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy,page_size", [("flat", 16), ("aligned", 16)])
def test_mixed_decode_step_syncs_at_most_once(tiny_folder, strategy, page_size):
    eng = build_engine(model=str(save_word_tokenizer(tiny_folder)), device="cuda",
                       dtype="bfloat16", encoder_kv=strategy, page_size=str(page_size),
                       cuda_graph=True, cuda_graph_max_bs=8, context_length=128,
                       max_total_tokens=8192, max_running_requests=8, debug_checks=False)
    for i, (prompt, images) in enumerate(mixed_cases()):
        sp = SamplingParams(max_new_tokens=30 + 2 * i, ignore_eos=True)
        eng.add_request(make_mllama_request(eng.model, prompt, images, sp))
    assert count_syncs(lambda: torch.ones(1, device="cuda").item()) == 1  # the probe works
    for _ in range(4):  # prefill + first decode steps
        eng.step()
    steps = 10
    syncs = count_syncs(lambda: [eng.step() for _ in range(steps)])
    assert syncs <= steps, f"{syncs} syncs in {steps} mixed decode steps"
    while eng.has_work():  # rows finish one by one: frees must not sync either
        assert count_syncs(eng.step) <= 1
    eng.check_integrity()


def _graph_or_cpu_engine(tiny_folder, device: str, graph: bool):
    """The tiny Mllama on the CPU (the reference), or on CUDA (flat/16, Triton attention)
    with or without decode + sampling graphs."""
    kw = dict(device=device, dtype="float32", context_length=64, max_running_requests=8)
    if device == "cuda":
        kw.update(encoder_kv="flat", page_size="16", attention_backend="triton",
                  cuda_graph=graph, cuda_graph_max_bs=8, max_total_tokens=8192)
    return build_engine(model=str(save_word_tokenizer(tiny_folder)), **kw)


def test_chat_filters_in_sampling_graphs_equal_eager(tiny_folder):
    """logit_bias and the penalties (capturable chat filters) give the same greedy tokens and
    log-probabilities with graphs (decode + sampling graphs) as eagerly, and as on the CPU."""
    from edserve.chat.sampling_filters import chat_filters

    def run(device, graph):
        eng = _graph_or_cpu_engine(tiny_folder, device, graph)
        sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
        reqs = []
        for i, (prompt, images) in enumerate(mixed_cases()):
            r = make_mllama_request(eng.model, prompt, images, sp)
            r.logits_processors = chat_filters({5: 4.0, 9: -2.0}, 1.5 if i % 2 else 0.0, 0.5)
            reqs.append(r)
        outs = eng.generate(reqs)
        eng.check_integrity()
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    ref_ids, ref_lps = run("cpu", False)
    for graph in (False, True):
        ids, lps = run("cuda", graph)
        assert ids == ref_ids
        for got, want in zip(lps, ref_lps, strict=True):
            assert got == pytest.approx(want, abs=1e-3)


def test_top_logprobs_in_sampling_graphs_equal_eager(tiny_folder):
    """Rows asking for top_logprobs (k = 3 and 5, beside rows asking none) get the same
    alternatives with graphs (their top-k inside the sampling graphs, the rows' places copied
    into the graph's static index) as eagerly, and as on the CPU."""
    def run(device, graph):
        eng = _graph_or_cpu_engine(tiny_folder, device, graph)
        reqs = [make_mllama_request(eng.model, prompt, images, SamplingParams(
            max_new_tokens=STEPS, ignore_eos=True, top_logprobs=(0, 3, 5)[i % 3]))
            for i, (prompt, images) in enumerate(mixed_cases())]
        outs = eng.generate(reqs)
        eng.check_integrity()
        return [o.token_ids for o in outs], [o.top_logprobs for o in outs]

    ref_ids, ref_tops = run("cpu", False)
    assert any(ref_tops) and not all(ref_tops)
    for graph in (False, True):
        ids, tops = run("cuda", graph)
        assert ids == ref_ids
        for got, want in zip(tops, ref_tops, strict=True):
            assert [[t for t, _ in step] for step in got] == [[t for t, _ in s] for s in want]
            assert [lp for step in got for _, lp in step] == \
                pytest.approx([lp for s in want for _, lp in s], abs=1e-3)
