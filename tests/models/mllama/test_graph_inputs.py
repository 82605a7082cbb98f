"""The CUDA-graph path's inputs for Mllama decode batches that mix image and text-only rows (CPU).

A captured decode graph reads :class:`edserve.engine.graph_inputs.GraphInputs` and runs
:func:`static_forward`. Here every decode step of a real engine is also loaded into those
buffers (padded past the batch, as replay pads) and run through ``static_forward`` eagerly: the
buffers must equal the eager batch's tensors (key ranges included), the padding rows must be
the harmless ones, and the logits must equal the eager path's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.graph_inputs import GraphInputs, reads_cross_kv_ranges, static_forward
from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import SamplingParams
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine
from tests.models.mllama.hf_tiny import save_word_tokenizer, synthetic_image

STEPS = 4
PAD = 3  # padding rows past the real batch, as a graph of a larger size would carry


def mixed_cases():
    """Image-first, text before the image, two images split by text (the last row sees only
    the second image: a range that is not [0, encoder_len)), and two text-only requests."""
    return [([128, 1, 15, 13, 14], [synthetic_image(100, 50, 0)]),
            ([1, 16, 128, 13], [synthetic_image(300, 40, 1)]),
            ([128, 1, 15, 128, 16, 17], [synthetic_image(50, 40, 2),
                                         synthetic_image(120, 120, 3)]),
            ([1, 18, 19, 10], []),
            ([1, 20, 9], [])]


def _check_step(model, pools, batch, input_ids, seen):
    bs = batch.batch_size
    grouped = pools.backend.grouped_cross
    inputs = GraphInputs(bs + PAD, pools.device, reads_cross_kv_ranges(model), grouped=grouped)
    assert inputs.accepts(batch)
    # with the grouped kernel the batch carries its groups (each row alone) and key ranges
    assert (batch.cross_groups is not None) == grouped
    if grouped:
        assert torch.equal(inputs.cross_groups[:bs + PAD, 0],
                           torch.arange(bs + PAD, device=pools.device))
    inputs.load(batch, input_ids, bs + PAD)
    pairs = [(inputs.input_ids, input_ids), (inputs.positions, batch.positions),
             (inputs.rows, batch.req_pool_indices), (inputs.seq_lens, batch.seq_lens),
             (inputs.out_loc, batch.out_cache_loc), (inputs.enc_lens, batch.encoder_lens),
             (inputs.enc_offsets, batch.encoder_offsets),
             (inputs.cross_ranges, batch.cross_kv_ranges)]
    for buf, eager in pairs:
        assert torch.equal(buf[:bs], eager.to(buf.dtype))
    for buf in (inputs.rows, inputs.out_loc, inputs.enc_lens, inputs.cross_ranges):
        assert not buf[bs:].any()  # padding: row 0, slot 0, no encoder, empty range
    assert torch.equal(inputs.seq_lens[bs:], torch.ones(PAD, dtype=torch.int32))

    batch.attn_backend.init_forward_metadata(batch)  # the runner's eager path
    eager = model.compute_logits(model(input_ids, batch.positions, batch, None))  # [B, V]
    static = static_forward(model, pools, inputs, bs + PAD)  # [B + PAD, V]
    torch.testing.assert_close(static[:bs], eager, rtol=1e-4, atol=1e-4)
    seen["steps"] += 1
    seen["mixed"] += bool((batch.encoder_lens == 0).any() and (batch.encoder_lens > 0).any())

    # A batch without ranges: every row reads [0, encoder_len) (Whisper-like requests).
    plain = dataclasses.replace(batch, cross_kv_ranges=None)
    inputs.load(plain, input_ids, bs + PAD)
    want = torch.stack([torch.zeros_like(batch.encoder_lens), batch.encoder_lens], 1)
    assert torch.equal(inputs.cross_ranges[:bs], want.to(torch.int32))


@pytest.mark.parametrize("strategy,page_size,ops", [
    ("aligned", 16, "torch"), ("flat", 1, "torch"), ("flat", 128, "torch"),
    ("aligned", 16, "triton"), ("flat", 1, "triton")])
def test_graph_inputs_equal_eager_for_mixed_batches(tiny_folder, strategy, page_size, ops):
    """``triton`` (the interpreter on CPU): decode steps read the encoder through the grouped
    cross-attention kernel with each row's key range, eager and from the graph buffers."""
    eng = build_engine(model=str(save_word_tokenizer(tiny_folder)), device="cpu", dtype="float32",
                       encoder_kv=strategy, page_size=str(page_size), context_length=64,
                       max_total_tokens=4096, max_running_requests=8, attention_backend=ops)
    assert eng.pools.backend.grouped_cross == (ops == "triton")
    assert eng.runner.graph_runner is None  # CPU: the eager path runs the steps
    runner, run = eng.runner, eng.runner.run
    seen = {"steps": 0, "mixed": 0}

    def checked_run(sched):
        if sched.mode == ForwardMode.DECODE:
            with torch.inference_mode():
                ids = runner.history.last(sched.batch.req_pool_indices)
                _check_step(runner.model, eng.pools, sched.batch, ids, seen)
        return run(sched)

    runner.run = checked_run
    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    reqs = [make_mllama_request(eng.model, p, imgs, sp) for p, imgs in mixed_cases()]
    outs = eng.generate(reqs)
    eng.check_integrity()
    assert [len(o.token_ids) for o in outs] == [STEPS] * len(reqs)
    assert seen["steps"] >= STEPS - 1 and seen["mixed"] == seen["steps"]


@pytest.mark.parametrize("strategy,page_size", [("aligned", 16), ("flat", 1)])
def test_grouped_kernel_with_ranges_matches_torch_reference(tiny_folder, strategy, page_size):
    """Mixed image / text-only / two-image requests: the Triton ops (decode cross-attention by
    the grouped kernel with per-row key ranges) give the torch reference's greedy tokens and
    logits, and leave the pools intact."""
    folder = str(save_word_tokenizer(tiny_folder))
    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    runs = {}
    for ops in ("torch", "triton"):
        eng = build_engine(model=folder, device="cpu", dtype="float32", encoder_kv=strategy,
                           page_size=str(page_size), context_length=64, max_total_tokens=4096,
                           max_running_requests=8, attention_backend=ops)
        recs = [LogitsRecorder() for _ in mixed_cases()]
        reqs = [dataclasses.replace(make_mllama_request(eng.model, p, imgs, sp),
                                    logits_processors=[r])
                for (p, imgs), r in zip(mixed_cases(), recs, strict=True)]
        runs[ops] = ([o.token_ids for o in eng.generate(reqs)], recs)
        eng.check_integrity()
    (ref_tokens, ref_recs), (tokens, recs) = runs["torch"], runs["triton"]
    assert tokens == ref_tokens
    for rec, ref in zip(recs, ref_recs, strict=True):
        assert len(rec.rows) == len(ref.rows) == STEPS
        for a, b in zip(rec.rows, ref.rows, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
