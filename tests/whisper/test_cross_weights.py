"""The alignment pass (``cross_attention_weights``) against HF transformers' ``cross_attentions``
(``output_attentions=True``, eager attention) on the same weights, float32: random small
weights with the cross K/V placed at scattered pool slots, and real tiny.en weights with the
K/V the engine itself wrote (read through ``on_finished_kv``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edserve.audio.decode import load_audio
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.mem_cache.kv_pool import KVPool
from edserve.models.weights import load_checkpoint
from edserve.models.whisper_loader import build_whisper
from edserve.whisper.cross_weights import Aligner, cross_attention_weights
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions
from tests.whisper_fixtures import DATA, make_random_whisper

TOL = 1e-4


def _hf(config: dict, state_dict: dict):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration(WhisperConfig(**config)).eval()
    hf.config._attn_implementation = "eager"  # attentions are returned by eager attention only
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in state_dict.items()},
                                             strict=False)
    assert unexpected == [] and set(missing) <= {"proj_out.weight"}
    hf.tie_weights()
    return hf


def _hf_cross(hf, mel: torch.Tensor, tokens: list[int]):
    with torch.no_grad():
        out = hf(input_features=mel[None].float(), decoder_input_ids=torch.tensor([tokens]),
                 output_attentions=True)
    return [a[0] for a in out.cross_attentions], out.logits[0]  # L x [H, T, S], [T, V]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    folder = make_random_whisper(tmp_path_factory.mktemp("rw") / "m", seed=3, layers=3)
    ckpt = load_checkpoint(folder)
    model, tok = build_whisper(ckpt, torch.float32, torch.device("cpu"))
    return model, tok, _hf(ckpt.config, ckpt.state_dict)


@pytest.mark.parametrize("heads", [[(0, 1), (1, 0), (2, 3), (2, 0)], [(0, 2), (1, 3)]])
def test_random_weights_match_hf(random_model, heads):
    model, tok, hf = random_model
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(80, 3000, generator=gen)
    tokens = [tok.sot, tok.no_timestamps] + tok.encode(" ask not what your country") + [tok.eot]
    enc = model.encode([mel])[0]  # [1500, d]
    L, H, hd = 3, 4, 16
    pool = KVPool(4096, 16, L, H, hd)
    slots = torch.randperm(4096, generator=gen)[:1500] + 16  # scattered, past the pad page
    for i, (k, v) in enumerate(model.model.decoder.cross_kv(enc)):
        pool.set_kv(i, slots, k, v)
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    weights, logits = cross_attention_weights(model, pool, slots, tokens, heads,
                                              with_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffers + pool.v_buffers,
                                                  strict=True))  # read-only
    cross, hf_logits = _hf_cross(hf, mel, tokens)
    assert weights.shape == (len(heads), len(tokens), 1500)
    for n, (layer, h) in enumerate(heads):
        torch.testing.assert_close(weights[n], cross[layer][h], atol=TOL, rtol=0)
    torch.testing.assert_close(logits, hf_logits, atol=1e-3, rtol=1e-4)
    alone, none = cross_attention_weights(model, pool, slots, tokens, heads)  # early stop
    assert none is None and torch.allclose(alone, weights, atol=1e-6)


def test_bad_heads_are_refused(random_model):
    model, tok, _ = random_model
    pool = KVPool(1536, 16, 3, 4, 16)
    with pytest.raises(ValueError, match="outside"):
        cross_attention_weights(model, pool, torch.arange(16, 1516), [tok.sot], [(3, 0)])


def test_tiny_en_engine_kv_matches_hf():
    """tiny.en: the engine decodes jfk (aligned encoder KV: padded rows, page size 16); the
    hook reads its pool; HF gets the same features and tokens."""
    from edserve.runtime import build_engine

    engine = build_engine(device="cpu", page_size="16", encoder_kv="aligned",
                    max_running_requests=2)
    tok = engine.tokenizer
    audio = load_audio(DATA / "jfk.wav")
    mel = LongformTask(audio, tok, 80, TranscribeOptions()).mel[:, :3000].contiguous()
    heads = [(1, 0), (2, 0), (2, 5), (3, 0), (3, 4)]
    seen = {}

    def hook(kv):
        text = [t for t in kv.token_ids if t < tok.eot]
        seq = [tok.sot, tok.no_timestamps] + text + [tok.eot]
        seen["tokens"] = seq
        seen["w"], _ = cross_attention_weights(engine.model, kv.kv_pool, kv.encoder_slots, seq,
                                               heads)
        seen["alignment"] = Aligner(engine.model, heads).capture(
            kv, [tok.sot, tok.no_timestamps], text, tok.eot)

    req = GenerateRequest([tok.sot, tok.no_timestamps], mel,
                          SamplingParams(max_new_tokens=40), on_finished_kv=hook)
    out = engine.generate([req])[0]
    assert "country" in tok.decode(out.token_ids)
    ckpt = load_checkpoint(None)
    hf = _hf(ckpt.config, ckpt.state_dict)
    cross, hf_logits = _hf_cross(hf, mel, seen["tokens"])
    for n, (layer, h) in enumerate(heads):
        torch.testing.assert_close(seen["w"][n], cross[layer][h], atol=TOL, rtol=0)
    al = seen["alignment"]
    assert al.weights.device.type == "cpu" and torch.allclose(al.weights, seen["w"])
    text = seen["tokens"][2:-1]
    ref = torch.softmax(hf_logits[1:1 + len(text), :tok.eot], dim=-1)[np.arange(len(text)), text]
    np.testing.assert_allclose(al.text_probs, ref.numpy(), atol=1e-4)
