"""HF folders (single-file and sharded safetensors) read back exactly; damage -> WeightsError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from edserve.models.weights import WeightsError, read_hf_folder

TINY = dict(
    vocab_size=120, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
    decoder_ffn_dim=64, max_source_positions=20, max_target_positions=24,
    bos_token_id=101, eos_token_id=100, pad_token_id=100, decoder_start_token_id=101,
)


@pytest.fixture(scope="module")
def model() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(**TINY))


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_sharded")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="50KB")
    return folder


def _expected(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k != "proj_out.weight"}  # tied


@pytest.mark.parametrize("which", ["saved", "sharded"])
def test_round_trip_is_identical(request, model, which):
    folder = request.getfixturevalue(which)
    if which == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert not (folder / "model.safetensors").exists()
    config, sd = read_hf_folder(folder)
    expected = _expected(model)
    assert sd.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(sd[name], tensor), name
    assert {k: config[k] for k in TINY} == TINY
    rebuilt = WhisperForConditionalGeneration(WhisperConfig(**config))
    result = rebuilt.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["proj_out.weight"] and result.unexpected_keys == []


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_corrupt_safetensors(tmp_path, saved):
    folder = _copy(saved, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    for damaged in (data[: len(data) // 2], b"\xff" * 64, data[:8] + b"X" + data[9:]):
        weights.write_bytes(damaged)
        with pytest.raises(WeightsError, match="model.safetensors"):
            read_hf_folder(folder)


def test_bad_config_and_missing_files(tmp_path, saved, sharded):
    folder = _copy(saved, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="config.json"):
        read_hf_folder(folder)
    (folder / "config.json").unlink()
    with pytest.raises(WeightsError, match="config.json"):
        read_hf_folder(folder)
    folder = _copy(saved, tmp_path / "no_weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="model.safetensors"):
        read_hf_folder(folder)
    folder = _copy(sharded, tmp_path / "s")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(WeightsError, match=shard):
        read_hf_folder(folder)
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(WeightsError, match="index.json"):
        read_hf_folder(folder)
