"""``--encoder-dtype bfloat16``: a bfloat16 Whisper encoder beside a float32 / int8 decoder
(edserve.models.encoder_bf16), and what ``auto`` becomes on a machine
(edserve.runtime.settings.resolve_encoder_dtype)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from edserve.models.encoder_bf16 import encoder_in_bf16
from edserve.models.fp8 import apply_encoder_dtype, check_fp8
from edserve.models.quantize import Int8Linear, quantize_model
from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.runtime.settings import resolve_encoder_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AMX = frozenset({"avx512", "avx512_bf16", "amx_tile"})
NO_AMX = frozenset({"avx512", "avx512_bf16"})
CFG = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                    encoder_ffn_dim=256, decoder_layers=2, decoder_attention_heads=4,
                    decoder_ffn_dim=256, num_mel_bins=80, max_source_positions=1500,
                    max_target_positions=448, vocab_size=51864)
JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


@pytest.mark.parametrize("mode,quant,device,compute,features,want", [
    ("auto", "int8", CPU, torch.float32, AMX, "bfloat16"),  # AMX: the encoder in bf16
    ("auto", "int8", CPU, torch.float32, NO_AMX, "auto"),  # no AMX tiles: int8 everywhere
    ("auto", "none", CPU, torch.float32, AMX, "auto"),  # float32 asked for: kept
    ("auto", "none", CUDA, torch.bfloat16, AMX, "auto"),
    ("bfloat16", "none", CPU, torch.float32, NO_AMX, "bfloat16"),  # asked for: everywhere
    ("bfloat16", "none", CPU, torch.bfloat16, AMX, "auto"),  # already the compute dtype
    ("fp8", "none", CUDA, torch.bfloat16, AMX, "fp8"),
    ("same", "int8", CPU, torch.float32, AMX, "auto"),  # the encoder quantized, as before
])
def test_resolve(mode, quant, device, compute, features, want):
    assert resolve_encoder_dtype(mode, quant, device, compute, features) == want


def test_resolve_follows_the_auto_dtype_override(monkeypatch):
    """``$EDSERVE_CPU_AUTO_DTYPE`` (the tests' float32 oracles) decides for this CPU."""
    monkeypatch.setenv("EDSERVE_CPU_AUTO_DTYPE", "float32")
    assert resolve_encoder_dtype("auto", "int8", CPU, torch.float32) == "auto"
    monkeypatch.setenv("EDSERVE_CPU_AUTO_DTYPE", "bfloat16")
    assert resolve_encoder_dtype("auto", "int8", CPU, torch.float32) == "bfloat16"


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="--encoder-dtype must be one of"):
        check_fp8("float16", "auto", "none", CPU, "torch", torch.float32)
    with pytest.raises(ValueError, match="Whisper models only"):
        encoder_in_bf16(nn.Linear(2, 2))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_int8_decoder_with_a_bfloat16_encoder():
    """The encoder keeps float linears and runs in bf16; the decoder (cross K/V included) and
    the logits stay int8 over float32; encode() hands the decoder float32 states close to the
    float32 model's."""
    torch.manual_seed(0)
    fp32 = WhisperForConditionalGeneration(CFG).eval()
    q = apply_encoder_dtype(quantize_model(copy.deepcopy(fp32), "int8", encoder=False),
                            "bfloat16")
    enc, dec = q.model.encoder, q.model.decoder
    assert {p.dtype for p in enc.parameters()} == {torch.bfloat16}
    assert not any(isinstance(m, Int8Linear) for m in enc.modules())
    assert isinstance(enc.layers[0].fc1, nn.Linear)
    n_int8 = sum(isinstance(m, Int8Linear) for m in q.modules())
    assert n_int8 == 7 * CFG.decoder_layers + 1  # q/k/v, out, cross q, out, k|v, fc1, fc2; logits
    assert {p.dtype for p in dec.layer_norm.parameters()} == {torch.float32}
    mel = torch.randn(CFG.num_mel_bins, 3000)
    with torch.inference_mode():
        e32, ebf = fp32.encode([mel])[0], q.encode([mel])[0]
        assert ebf.dtype == torch.float32 and ebf.shape == e32.shape
        assert _rel(ebf, e32) < 0.05
        k, v = next(dec.cross_kv(ebf))  # the int8 cross K/V projection takes them
        assert k.dtype == torch.float32


def test_embedded_model_transcribes_jfk():
    """The embedded tiny.en, ``--quantization int8 --encoder-dtype bfloat16``: jfk's words."""
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    engine = build_engine(device="cpu", quantization="int8", encoder_dtype="bfloat16",
                          cpu_compile="off", max_running_requests=2)
    assert engine.model.model.encoder.conv1.weight.dtype == torch.bfloat16
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False)
    text = transcribe(engine, [str(JFK)], options=opts)[0].text
    words = re.sub(r"[^a-z ]", "", text.lower()).split()
    assert words == ("and so my fellow americans ask not what your country can do for you "
                     "ask what you can do for your country").split()
    engine.check_integrity()
