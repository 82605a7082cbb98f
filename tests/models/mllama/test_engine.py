"""Mllama through the real Engine (scheduler + runner): HF parity and batch invariance for a
mixed batch of 1-, 2-, 3- and 4-tile image requests and text-only requests."""

from __future__ import annotations

import pytest

from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.models.mllama.config import MllamaConfig
from edserve.multimodal.mllama_image import MllamaImageConfig, preprocess_images
from edserve.multimodal.mllama_prompt import build_cross_attention_layout
from tests.models.mllama.hf_reference import hf_greedy
from tests.models.mllama.hf_tiny import TINY_CONFIG, save_word_tokenizer, synthetic_image

STEPS = 8
SIZES = [(50, 40), (100, 50), (150, 50), (300, 40)]  # 1, 2, 3, 4 tiles at 56px


@pytest.fixture(scope="module")
def engine_folder(tiny_folder):
    return save_word_tokenizer(tiny_folder)


@pytest.fixture(scope="module")
def cases():
    cfg = MllamaImageConfig(image_size=56)
    imgs = [preprocess_images([synthetic_image(w, h, seed=i)], cfg)
            for i, (w, h) in enumerate(SIZES)]
    assert [x.num_tiles for x in imgs] == [(1,), (2,), (3,), (4,)]
    out = [([128, 1, 15 + i, 13, 14], img) for i, img in enumerate(imgs)]
    out += [([1, 18, 19, 10, 11, 13], None), ([1, 20, 9], None)]
    out.insert(2, ([128, 128, 1, 16, 17], preprocess_images(
        [synthetic_image(100, 50, 9), synthetic_image(120, 120, 8)], cfg)))
    return out


def _requests(cases):
    P = MllamaConfig.from_hf(TINY_CONFIG).vision.num_patches
    reqs = []
    for prompt, img in cases:
        tiles = img.num_tiles if img is not None else ()
        lay = build_cross_attention_layout(prompt, 128, tiles, P)
        reqs.append(GenerateRequest(
            prompt_ids=prompt, encoder_input=img,
            cross_kv_ranges=[tuple(r) for r in lay.ranges.tolist()] if img else None,
            sampling=SamplingParams(max_new_tokens=STEPS, ignore_eos=True)))
    return reqs


@pytest.mark.parametrize("strategy,page_size", [("aligned", 16), ("ragged", 1),
                                                 ("flat", 128)])
def test_engine_parity_and_invariance(engine_folder, hf_tiny, cases, strategy, page_size):
    refs = [hf_greedy(hf_tiny, p, img, STEPS)[0] for p, img in cases]
    results = {}
    for mrr in (1, 4):
        eng = Engine(model=str(engine_folder), device="cpu", dtype="float32",
                     encoder_kv=strategy, page_size=str(page_size), context_length=64,
                     max_total_tokens=4096, max_running_requests=mrr)
        outs = eng.generate(_requests(cases))
        eng.check_integrity()
        results[mrr] = [o.token_ids for o in outs]
    assert results[1] == results[4]
    assert results[4] == refs
