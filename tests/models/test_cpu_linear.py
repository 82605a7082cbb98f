"""oneDNN-prepacked float32 CPU linears (edserve.models.cpu_linear, ``--cpu-linear``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from whisper_fixtures import CLIPS, DATA

from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.models.cpu_linear import PackedLinear, pack_linears, use_onednn
from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

CPU = torch.device("cpu")
CFG = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                    encoder_ffn_dim=256, decoder_layers=2, decoder_attention_heads=4,
                    decoder_ffn_dim=256, num_mel_bins=80, max_source_positions=1500,
                    max_target_positions=448, vocab_size=51864)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (5, 48), (3, 4, 48), (0, 48)])
def test_packed_linear_matches_float64(shape, bias):
    torch.manual_seed(0)
    w, b = torch.randn(96, 48), torch.randn(96) if bias else None
    lin = PackedLinear(w, b, min_rows=2)
    x = torch.randn(*shape)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = lin(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if x.numel() and x.numel() < 2 * 48:  # one row: the float weight through F.linear, exactly
        assert torch.equal(got, F.linear(x, w, b))


def test_copy_and_compiled_call():
    torch.manual_seed(0)
    lin = PackedLinear(torch.randn(32, 16), torch.randn(32), min_rows=2)
    clone = copy.deepcopy(lin)
    assert clone.handle != lin.handle and clone.packed is not lin.packed
    x = torch.randn(4, 16)
    assert torch.equal(clone(x), lin(x))
    traced = torch.compile(lambda t: lin(t) + 1, backend="eager", fullgraph=True)
    assert torch.equal(traced(x), lin(x) + 1)  # the opaque op, no graph break


def test_pack_linears_whole_model():
    torch.manual_seed(0)
    ref = WhisperForConditionalGeneration(CFG).eval()
    packed = pack_linears(copy.deepcopy(ref))
    plain = {n for n, m in packed.named_modules() if isinstance(m, nn.Linear)}
    assert plain == {"model.decoder.cross_kv_proj"}  # sliced by the model: stays as it is
    n = sum(isinstance(m, PackedLinear) for m in packed.modules())
    assert n == 4 * CFG.encoder_layers + 6 * CFG.decoder_layers + 1  # + the logits head
    assert packed.cpu_linear == {"backend": "onednn", "linears": n - 1}
    assert [p for p, _ in packed.model.encoder.layers[0].self_attn.qkv_proj.parts] == \
        ["q_proj", "k_proj", "v_proj"]
    no_enc = pack_linears(copy.deepcopy(ref), encoder=False)  # --compile-encoder
    assert not any(isinstance(m, PackedLinear) for m in no_enc.model.encoder.modules())
    assert no_enc.cpu_linear["linears"] == 6 * CFG.decoder_layers
    torch.manual_seed(1)
    mel, hidden = torch.randn(CFG.num_mel_bins, 3000), torch.randn(5, CFG.d_model)
    with torch.inference_mode():
        torch.testing.assert_close(packed.encode([mel])[0], ref.encode([mel])[0],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed.compute_logits(hidden), ref.compute_logits(hidden),
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Whisper models only"):
        pack_linears(nn.Sequential(nn.Linear(4, 4)))


@pytest.mark.parametrize(("mode", "dtype", "quant", "vendor", "want"), [
    ("auto", torch.float32, "none", "AuthenticAMD", True),
    ("auto", torch.float32, "none", "GenuineIntel", False),
    ("auto", torch.float32, "none", "", True),
    ("onednn", torch.float32, "none", "GenuineIntel", True),
    ("mkl", torch.float32, "none", "AuthenticAMD", False),
    ("auto", torch.bfloat16, "none", "AuthenticAMD", False),  # bf16 already runs oneDNN
    ("auto", torch.float32, "int8", "AuthenticAMD", False),  # int8 has its own kernels
])
def test_when_linears_are_packed(mode, dtype, quant, vendor, want):
    assert use_onednn(mode, CPU, dtype, quant, vendor=vendor) is want


def test_bad_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="--cpu-linear must be one of"):
        use_onednn("blas", CPU, torch.float32, "none")
    with pytest.raises(ValueError, match="--cpu-linear must be auto, mkl or onednn"):
        EngineConfig(cpu_linear="blas")
    for device, dtype, quant in ((torch.device("meta"), torch.float32, "none"),
                                 (CPU, torch.bfloat16, "none"), (CPU, torch.float32, "int8")):
        assert not use_onednn("auto", device, dtype, quant)
        with pytest.raises(ValueError, match="--cpu-linear onednn applies to float32"):
            use_onednn("onednn", device, dtype, quant)
    with pytest.raises(ValueError, match="--cpu-linear onednn applies"):  # before loading
        build_engine(device="cpu", quantization="int8", cpu_linear="onednn",
                     model="/nonexistent")


@pytest.mark.parametrize("beam", [1, 5])
def test_embedded_model_text_equals_mkl(beam):
    """The bundled English clips give the same text with oneDNN's linears as with MKL's."""
    audios = [load_audio(DATA / f"{c}.wav") for c in CLIPS]
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=beam)
    texts = {}
    for mode in ("mkl", "onednn"):
        engine = build_engine(device="cpu", dtype="float32", cpu_linear=mode,
                              max_running_requests=len(CLIPS) * beam)
        assert (getattr(engine.model, "cpu_linear", None) is not None) == (mode == "onednn")
        texts[mode] = [r.text for r in transcribe(engine, audios, options=opts)]
    assert texts["onednn"] == texts["mkl"]
    assert all(t.strip() for t in texts["mkl"])
