"""Mllama through the real Engine (scheduler + runner): HF parity and batch invariance for a
mixed batch of 1-, 2-, 3- and 4-tile image requests, a two-image request and text-only
requests; requests built from raw images with ``make_mllama_request``."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.request import SamplingParams
from edserve.multimodal import ImageInputError
from edserve.multimodal.mllama_image import MllamaImageConfig, preprocess_images
from edserve.runtime import build_engine
from tests.models.mllama.hf_reference import hf_greedy
from tests.models.mllama.hf_tiny import save_word_tokenizer, synthetic_image

STEPS = 8
SIZES = [(50, 40), (100, 50), (150, 50), (300, 40)]  # 1, 2, 3, 4 tiles at 56px


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def engine_folder(tiny_folder):
    return save_word_tokenizer(tiny_folder)


@pytest.fixture(scope="module")
def cases():
    """(prompt ids, image sources); all image rows see an image (exact in both modes)."""
    out = [([128, 1, 15 + i, 13, 14], [synthetic_image(w, h, seed=i)])
           for i, (w, h) in enumerate(SIZES)]
    out[1] = (out[1][0], [_data_url(out[1][1][0])])
    out.insert(2, ([128, 128, 1, 16, 17], [synthetic_image(100, 50, 9),
                                            synthetic_image(120, 120, 8)]))
    return out + [([1, 18, 19, 10, 11, 13], []), ([1, 20, 9], [])]


def _engine(folder, strategy, page_size, mrr, ops="torch"):
    return build_engine(model=str(folder), device="cpu", dtype="float32", encoder_kv=strategy,
                  page_size=str(page_size), context_length=64, max_total_tokens=4096,
                  max_running_requests=mrr, attention_backend=ops)


@pytest.mark.parametrize("strategy,page_size", [("aligned", 16), ("ragged", 1),
                                                 ("flat", 128)])
def test_engine_parity_and_invariance(engine_folder, hf_tiny, cases, strategy, page_size):
    cfg = MllamaImageConfig(image_size=56)
    refs = [hf_greedy(hf_tiny, p, preprocess_images(imgs, cfg), STEPS)[0] for p, imgs in cases]
    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    results = {}
    for mrr in (1, 4):
        eng = _engine(engine_folder, strategy, page_size, mrr)
        reqs = [make_mllama_request(eng.model, p, imgs, sp) for p, imgs in cases]
        assert [eng.model.encoder_len(r.encoder_input) for r in reqs] == \
            [17, 34, 102, 51, 68, 0, 0]
        outs = eng.generate(reqs)
        eng.check_integrity()
        results[mrr] = [o.token_ids for o in outs]
    assert results[1] == results[4]
    assert results[4] == refs


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton "
                    "interpreter, which conftest turns on only without CUDA (the CUDA kernels: "
                    "test_gpu_graph.py)")
def test_triton_ops_match_hf(engine_folder, hf_tiny, cases, monkeypatch, request):
    """The triton op set (attention, RMSNorm, SiLU-and-multiply, RoPE kernels; the CPU
    interpreter here) gives HF's greedy tokens."""
    from edserve.kernels import norm_act, rope
    from edserve.layers import elementwise

    calls = {"rms_norm": 0, "silu_mul": 0, "rope": 0}

    def spy(name, fn):
        def counted(*args):
            calls[name] += 1
            return fn(*args)
        return counted

    for mod, name in ((norm_act, "rms_norm"), (norm_act, "silu_mul"), (rope, "rope")):
        monkeypatch.setattr(mod, name, spy(name, getattr(mod, name)))
    elementwise._triton_ops.cache_clear()  # the op set is rebuilt with the spies ...
    request.addfinalizer(elementwise._triton_ops.cache_clear)  # ... and dropped afterwards
    cfg = MllamaImageConfig(image_size=56)
    picked = [cases[0], cases[3], cases[-1]]  # 1 and 3 tiles, text-only
    steps = 4  # the interpreter is slow
    refs = [hf_greedy(hf_tiny, p, preprocess_images(imgs, cfg), steps)[0] for p, imgs in picked]
    eng = _engine(engine_folder, "flat", 16, 4, ops="triton")
    sp = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    outs = eng.generate([make_mllama_request(eng.model, p, imgs, sp) for p, imgs in picked])
    eng.check_integrity()
    assert [o.token_ids for o in outs] == refs
    assert min(calls.values()) > 0, calls


def test_request_errors(engine_folder):
    eng = _engine(engine_folder, "flat", 1, 2)
    img = synthetic_image(60, 60)
    with pytest.raises(ImageInputError, match="must match"):
        make_mllama_request(eng.model, [1, 128, 128, 5], [img])
    with pytest.raises(ImageInputError, match="too many images"):
        make_mllama_request(eng.model, [128] * 5 + [1], [img] * 5)
    with pytest.raises(ImageInputError, match="remote image URLs are refused"):
        make_mllama_request(eng.model, [128, 1], ["https://example.com/a.png"])


def test_top_logprobs_are_hfs_log_softmax_top_k(engine_folder, hf_tiny, cases):
    """``top_logprobs=k``: at every generated token, the k most likely tokens of HF's
    log-softmax at that position with their log-probabilities, best first; rows asking for
    different k (and rows asking none) share one batch, and only the asking rows get them."""
    cfg = MllamaImageConfig(image_size=56)
    picked = [cases[0], cases[2], cases[-2]]  # one image, two images, text-only
    eng = _engine(engine_folder, "flat", 16, 4)
    reqs = [make_mllama_request(eng.model, p, imgs,
                                SamplingParams(max_new_tokens=STEPS, ignore_eos=True,
                                               top_logprobs=k))
            for (p, imgs), k in zip(picked, (5, 0, 20), strict=True)]
    outs = eng.generate(reqs)
    eng.check_integrity()
    assert outs[1].top_logprobs == []
    for (p, imgs), out, k in ((picked[0], outs[0], 5), (picked[2], outs[2], 20)):
        tokens, logits = hf_greedy(hf_tiny, p, preprocess_images(imgs, cfg), STEPS)
        assert out.token_ids == tokens and len(out.top_logprobs) == STEPS
        ref = torch.log_softmax(logits.double(), dim=-1).topk(k)
        for t, alternatives in enumerate(out.top_logprobs):
            ids, lps = zip(*alternatives, strict=True)
            assert list(ids) == ref.indices[t].tolist()
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref.values[t],
                                       atol=1e-4, rtol=0)
            assert alternatives[0] == (out.token_ids[t], pytest.approx(out.logprobs[t]))
