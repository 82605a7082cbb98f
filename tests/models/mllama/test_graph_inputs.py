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
    inputs = GraphInputs(bs + PAD, pools.device, reads_cross_kv_ranges(model))
    assert inputs.accepts(batch)
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
    torch.testing.assert_close(static[:bs], eager, rtol=1e-5, atol=1e-5)
    seen["steps"] += 1
    seen["mixed"] += bool((batch.encoder_lens == 0).any() and (batch.encoder_lens > 0).any())

    # A batch without ranges: every row reads [0, encoder_len) (Whisper-like requests).
    plain = dataclasses.replace(batch, cross_kv_ranges=None)
    inputs.load(plain, input_ids, bs + PAD)
    want = torch.stack([torch.zeros_like(batch.encoder_lens), batch.encoder_lens], 1)
    assert torch.equal(inputs.cross_ranges[:bs], want.to(torch.int32))


@pytest.mark.parametrize("strategy,page_size", [("aligned", 16), ("flat", 1), ("flat", 128)])
def test_graph_inputs_equal_eager_for_mixed_batches(tiny_folder, strategy, page_size):
    eng = build_engine(model=str(save_word_tokenizer(tiny_folder)), device="cpu", dtype="float32",
                       encoder_kv=strategy, page_size=str(page_size), context_length=64,
                       max_total_tokens=4096, max_running_requests=8)
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


def test_graph_rows_of_a_reuser_without_the_image(tiny_folder):
    """A request reusing a kept region without its image (``encoder_kv``, no
    ``encoder_input``) is an image row in the graph's buffers (its encoder length and key
    ranges are the handle's), decodes in a batch with text-only rows like the request that
    carried the image, and the static path equals the eager one."""
    eng = build_engine(model=str(save_word_tokenizer(tiny_folder)), device="cpu", dtype="float32",
                       encoder_kv="aligned", page_size="16", context_length=64,
                       max_total_tokens=4096, max_running_requests=8)
    runner, run = eng.runner, eng.runner.run
    seen = {"steps": 0, "mixed": 0}
    enc_lens: list[list[int]] = []

    def checked_run(sched):
        if sched.mode == ForwardMode.DECODE:
            enc_lens.append(sched.batch.encoder_lens.tolist())
            with torch.inference_mode():
                ids = runner.history.last(sched.batch.req_pool_indices)
                _check_step(runner.model, eng.pools, sched.batch, ids, seen)
        return run(sched)

    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    (prompt, images), text = mixed_cases()[0], mixed_cases()[3]
    [kept] = eng.generate([make_mllama_request(eng.model, prompt, images, sp)])
    keep = dataclasses.replace(make_mllama_request(eng.model, prompt, images, sp),
                               keep_encoder=True)
    [held] = eng.generate([keep])
    handle = held.encoder_kv
    assert held.token_ids == kept.token_ids and handle.encoder_len == 34
    runner.run = checked_run
    bare = dataclasses.replace(make_mllama_request(eng.model, prompt, images, sp),
                               encoder_kv=handle, encoder_input=None)
    outs = eng.generate([bare, make_mllama_request(eng.model, text[0], text[1], sp)])
    assert outs[0].token_ids == kept.token_ids
    assert seen["steps"] >= STEPS - 1 and seen["mixed"] == seen["steps"]
    assert all(lens[0] == handle.encoder_len for lens in enc_lens)  # the reuser's row
    eng.release_encoder(handle)
    eng.step()
    eng.check_integrity()
    assert eng.pools.allocator.num_used() == 0
