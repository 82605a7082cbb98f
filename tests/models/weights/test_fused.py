"""Fused projections: HF-named tensors land in the right rows, mismatches are named, and the
prefill's stacked cross K/V projection equals HF's per-layer k_proj/v_proj (in any grouping)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edserve.models import whisper as ours_whisper
from edserve.models.weights.fused import FusedLinear, load_hf_tensors

D, L, H = 32, 3, 4


@pytest.fixture(scope="module")
def hf_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=100, num_mel_bins=8, d_model=D, encoder_layers=2,
                        decoder_layers=L, encoder_attention_heads=H, decoder_attention_heads=H,
                        encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D, max_source_positions=16,
                        max_target_positions=8, pad_token_id=1, bos_token_id=1,
                        eos_token_id=1, decoder_start_token_id=2)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _sd(hf) -> dict[str, torch.Tensor]:
    return {k: v for k, v in hf.state_dict().items() if k != "proj_out.weight"}


def _ours(hf) -> ours_whisper.WhisperForConditionalGeneration:
    model = ours_whisper.WhisperForConditionalGeneration(
        ours_whisper.WhisperConfig.from_hf(hf.config.to_dict()))
    model.load_weights(_sd(hf))
    return model.eval()


def test_whisper_rows(hf_whisper):
    model, sd = _ours(hf_whisper), _sd(hf_whisper)
    for side, i in (("encoder", 1), ("decoder", 0)):
        pre = f"model.{side}.layers.{i}.self_attn"
        fused = model.get_submodule(pre).qkv_proj  # [3D, D]
        want = torch.cat([sd[f"{pre}.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(fused.weight, want)
        zeros = torch.zeros(D)
        assert torch.equal(fused.bias, torch.cat([sd[f"{pre}.q_proj.bias"], zeros,
                                                  sd[f"{pre}.v_proj.bias"]]))
    cross = model.model.decoder.cross_kv_proj  # [L * 2D, D]: rows (layer, k|v)
    for i in range(L):
        pre = f"model.decoder.layers.{i}.encoder_attn"
        k, v = cross.weight[2 * i * D: (2 * i + 1) * D], cross.weight[(2 * i + 1) * D:
                                                                      (2 * i + 2) * D]
        assert torch.equal(k, sd[f"{pre}.k_proj.weight"])
        assert torch.equal(v, sd[f"{pre}.v_proj.weight"])
        assert not cross.bias[2 * i * D: (2 * i + 1) * D].any()
        assert torch.equal(cross.bias[(2 * i + 1) * D: (2 * i + 2) * D], sd[f"{pre}.v_proj.bias"])


def test_own_state_dict_loads_back(hf_whisper):
    model = _ours(hf_whisper)
    again = ours_whisper.WhisperForConditionalGeneration(model.config)
    again.load_weights(model.state_dict())
    for (na, a), (nb, b) in zip(model.state_dict().items(), again.state_dict().items(),
                                strict=True):
        assert na == nb and torch.equal(a, b)


@pytest.mark.parametrize("damage, match", [
    ("drop", r"missing \['model.decoder.layers.1.encoder_attn.v_proj.bias'\]"),
    ("extra", r"unexpected \['model.decoder.layers.0.encoder_attn.k_proj.bias'\]"),
    ("twice", "loaded twice"),
    ("shape", r"q_proj.weight: shape \(3, 32\)"),
])
def test_mismatches_are_named(hf_whisper, damage, match):
    sd = _sd(hf_whisper)
    if damage == "drop":
        del sd["model.decoder.layers.1.encoder_attn.v_proj.bias"]
    elif damage == "extra":  # HF's k_proj has no bias: a checkpoint with one does not fit
        sd["model.decoder.layers.0.encoder_attn.k_proj.bias"] = torch.zeros(D)
    elif damage == "twice":
        sd["model.encoder.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(3 * D, D)
    else:
        sd["model.encoder.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, D)
    model = ours_whisper.WhisperForConditionalGeneration(
        ours_whisper.WhisperConfig.from_hf(hf_whisper.config.to_dict()))
    with pytest.raises(ValueError, match=match):
        model.load_weights(sd)


@pytest.mark.parametrize("chunk_bytes", [1, 2 * 5 * 2 * D * 4, 1 << 30])  # 1 / 2 / all layers
def test_cross_kv_matches_hf_per_layer(hf_whisper, monkeypatch, chunk_bytes):
    monkeypatch.setattr(ours_whisper, "CROSS_KV_CHUNK_BYTES", chunk_bytes)
    model = _ours(hf_whisper)
    enc = torch.randn(5, D)  # [S, d]
    with torch.no_grad():
        got = list(model.model.decoder.cross_kv(enc))
    assert len(got) == L
    for layer, (k, v) in zip(hf_whisper.model.decoder.layers, got, strict=True):
        a = layer.encoder_attn
        assert k.shape == v.shape == (5, H, D // H)
        torch.testing.assert_close(k, a.k_proj(enc).view(5, H, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, a.v_proj(enc).view(5, H, -1), rtol=1e-5, atol=1e-5)


def test_fused_linear_split_and_zero_bias():
    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fused = FusedLinear(4, [("a", 2), ("b.c", 3)], no_bias=["b.c"])

    m = Parent()
    tensors = {"a.weight": torch.ones(2, 4), "a.bias": torch.full((2,), 5.0),
               "b.c.weight": torch.full((3, 4), 2.0)}
    load_hf_tensors(m, tensors)
    x = torch.ones(1, 4)
    a, c = m.fused.split(m.fused(x))  # [1, 2], [1, 3]
    torch.testing.assert_close(a, torch.full((1, 2), 9.0))
    torch.testing.assert_close(c, torch.full((1, 3), 8.0))
    torch.testing.assert_close(m.fused(x), F.linear(x, m.fused.weight, m.fused.bias))
