"""Config parsing (HF 5 and 4.x layouts), weight loading (both naming layouts), RoPE."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from edserve.models.mllama import MllamaConfig, load_mllama
from edserve.models.mllama.config import RopeConfig
from edserve.models.mllama.loader import build_mllama
from edserve.models.mllama.rope import rope_inv_freq
from tests.models.mllama.hf_tiny import TINY_CONFIG

# An 11B-style config.json as transformers 4.x wrote it (rope_scaling + rope_theta, eos list).
CONFIG_11B_V4 = {
    "model_type": "mllama", "image_token_index": 128256,
    "text_config": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 40, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                    "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
                    "rope_theta": 500000.0, "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                    "eos_token_id": [128001, 128008, 128009], "pad_token_id": 128004,
                    "bos_token_id": 128000},
    "vision_config": {"hidden_size": 1280, "attention_heads": 16, "intermediate_size": 5120,
                      "num_hidden_layers": 32, "num_global_layers": 8, "image_size": 560,
                      "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 7680,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30],
                      "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1],
                                                  [2, 2], [3, 1], [4, 1]]},
}


def test_parse_11b_v4_config():
    cfg = MllamaConfig.from_hf(CONFIG_11B_V4, vision_intermediate_semantics="meta")
    assert cfg.text.head_dim == 128 and cfg.vision.num_patches == 1601
    assert cfg.text.rope == RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_id == 128001 and cfg.stop_token_ids == (128001, 128008, 128009)
    assert cfg.vision.aspect_ratios[5] == (2, 2)
    assert cfg.vision_intermediate_semantics == "meta"


def test_rope_matches_hf():
    from transformers import MllamaTextConfig as HFText
    from transformers.models.mllama.modeling_mllama import MllamaRotaryEmbedding

    for text in (TINY_CONFIG["text_config"], CONFIG_11B_V4["text_config"]):
        hf = MllamaRotaryEmbedding(HFText(**copy.deepcopy(text)))
        ours = rope_inv_freq(RopeConfig.from_hf(text),
                             text["hidden_size"] // text["num_attention_heads"])
        assert torch.equal(ours, hf.inv_freq)


def test_bad_switch_and_dims():
    with pytest.raises(ValueError, match="vision_intermediate_semantics"):
        MllamaConfig.from_hf(TINY_CONFIG, vision_intermediate_semantics="x")
    bad = copy.deepcopy(TINY_CONFIG)
    bad["vision_config"]["vision_output_dim"] = 64
    with pytest.raises(ValueError, match="vision_output_dim"):
        MllamaConfig.from_hf(bad)


def _v4_name(name: str) -> str:
    """transformers 5 name -> the 4.x / published-checkpoint name."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return name[len("model."):]


def test_loads_v4_layout_identically(tiny_folder, hf_tiny, tmp_path):
    sd = {_v4_name(k): v.contiguous() for k, v in hf_tiny.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    a, b = load_mllama(tiny_folder), load_mllama(tmp_path)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_missing_weight_is_an_error(hf_tiny, tmp_path):
    sd = {k: v.contiguous() for k, v in hf_tiny.state_dict().items() if "q_norm" not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(ValueError, match="missing"):
        load_mllama(tmp_path)


def test_registry_builder(hf_tiny):
    class Ckpt:
        config = TINY_CONFIG
        state_dict = hf_tiny.state_dict()
        tokenizer_path = None

    model, tok = build_mllama(Ckpt(), torch.float32, torch.device("cpu"))
    assert tok is None and model.num_kv_heads == 2
    assert model.num_kv_layers == 3  # 3 self layers + 1 cross layer sharing pool layer 0
    assert model.head_dim == 16 and model.max_encoder_len == 4 * 4 * 17
    assert torch.equal(model.lm_head.weight, hf_tiny.lm_head.weight)


def test_fused_projections_hold_hf_rows(hf_tiny):
    """q/k/v, cross k/v and gate/up are fused at load time; an own state_dict loads back."""
    sd = hf_tiny.state_dict()
    model = build_mllama(type("Ckpt", (), {"config": TINY_CONFIG, "state_dict": sd})(),
                         torch.float32, torch.device("cpu"))[0]
    lm = "model.language_model.layers"
    self_layer = next(i for i in range(4) if f"{lm}.{i}.self_attn.q_proj.weight" in sd)
    cross_layer = next(i for i in range(4) if f"{lm}.{i}.cross_attn.k_proj.weight" in sd)
    layers = model.language_model.layers
    torch.testing.assert_close(layers[self_layer].self_attn.qkv_proj.weight, torch.cat(
        [sd[f"{lm}.{self_layer}.self_attn.{p}_proj.weight"] for p in "qkv"]), rtol=0, atol=0)
    torch.testing.assert_close(layers[self_layer].mlp.gate_up_proj.weight, torch.cat(
        [sd[f"{lm}.{self_layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")]), rtol=0, atol=0)
    torch.testing.assert_close(layers[cross_layer].cross_attn.kv_proj.weight, torch.cat(
        [sd[f"{lm}.{cross_layer}.cross_attn.{p}_proj.weight"] for p in "kv"]), rtol=0, atol=0)
    again = build_mllama(type("Ckpt", (), {"config": TINY_CONFIG,
                                           "state_dict": model.state_dict()})(),
                         torch.float32, torch.device("cpu"))[0]
    for (na, a), (nb, b) in zip(model.state_dict().items(), again.state_dict().items(),
                                strict=True):
        assert na == nb and torch.equal(a, b)


def test_self_and_cross_layers_share_kv_pool_layers():
    """The 11B layout: 32 self + 8 cross layers in a 32-layer pool; each pool layer serves at
    most one self layer (decoder slots) and one cross layer (encoder slots)."""
    from edserve.models.mllama.text import kv_pool_layers

    text = MllamaConfig.from_hf(CONFIG_11B_V4).text
    ids = kv_pool_layers(text)
    cross = text.cross_attention_layers
    assert [ids[i] for i in cross] == list(range(8))
    assert [k for i, k in enumerate(ids) if i not in cross] == list(range(32))
    assert ids[:5] == [0, 1, 2, 0, 3]
    assert max(ids) + 1 == 32  # one per text layer would be 40: a fifth more KV memory
