"""fp8 options (edserve.models.fp8): the emulated fp8 linear against a float64 oracle of the
same rounding, the encoder rewrite, start-up errors, and the engine on tiny.en's real speech
(the fp8 KV pool included, word timestamps reading it)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from whisper_fixtures import make_random_whisper

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.layers.linear_gelu import LINEAR_GELU, linear_only, set_linear_gelu
from edserve.models.fp8 import (
    FP8,
    Fp8Linear,
    apply_encoder_dtype,
    check_fp8,
    quantize_rows,
)
from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.runtime import build_engine
from edserve.whisper.transcribe import transcribe

CFG = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                    encoder_ffn_dim=256, decoder_layers=2, decoder_attention_heads=4,
                    decoder_ffn_dim=256, num_mel_bins=80, max_source_positions=1500,
                    max_target_positions=448, vocab_size=51864)
CPU = torch.device("cpu")


def _e4m3_f64(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to e4m3 (3 mantissa bits, saturating at 448) in float64 math."""
    a = x.abs().clamp(max=448.0)
    exp = torch.floor(torch.log2(a.clamp(min=2.0 ** -6)))  # subnormals share 2^-6's step
    step = 2.0 ** (exp - 3)
    return torch.sign(x) * torch.round(a / step) * step  # round half to even, like torch


def test_fp8_linear_is_the_rounded_product():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64) * 3
    with torch.no_grad():
        y, exact = Fp8Linear(lin)(x), lin(x)  # [2, 5, 48]
    # oracle: per-row scales, e4m3 rounding, product and bias in float64
    xf, wf = x.reshape(-1, 64).double(), lin.weight.detach().double()
    xs = xf.abs().amax(1, keepdim=True).float().double() / 448
    ws = wf.abs().amax(1, keepdim=True).float().double() / 448
    ref = (_e4m3_f64(xf / xs) * xs) @ (_e4m3_f64(wf / ws) * ws).T + lin.bias.double()
    assert y.shape == (2, 5, 48)
    assert torch.allclose(y.reshape(-1, 48).double(), ref, rtol=1e-5, atol=1e-5)
    rel = float((y - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.05  # it does round (and not by much)


def test_quantize_rows_saturates_and_keeps_zero_rows():
    x = torch.tensor([[1.0, -2.0, 4.0], [0.0, 0.0, 0.0]])
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (2, 1)
    assert q[0].float().tolist() == [112.0, -224.0, 448.0]  # 1/(4/448) = 112 exactly
    assert torch.equal(q[1].float() * s[1], x[1])


def test_encoder_rewrite_touches_only_the_encoder_layers():
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(CFG).eval()
    fp8 = apply_encoder_dtype(copy.deepcopy(model), "fp8")
    names = sorted(n for n, m in fp8.named_modules() if isinstance(m, Fp8Linear))
    assert len(names) == 4 * CFG.encoder_layers and all(".encoder.layers." in n for n in names)
    assert apply_encoder_dtype(model, "auto") is model
    mel = torch.randn(1, 80, 3000)
    with torch.no_grad():
        a, b = model.model.encoder(mel), fp8.model.encoder(mel)
    assert 0 < float((a - b).norm() / a.norm()) < 0.05
    with pytest.raises(ValueError, match="Whisper models only"):
        apply_encoder_dtype(nn.Linear(2, 2), "fp8")


def test_the_mlp_gelu_moves_into_fc2s_input_quantization():
    """fp8: the GELU after ``fc1`` is applied by ``fc2``'s input quantization (one kernel on
    CUDA); on CPU the encoder's output is bit for bit that of the GELU kept in the layer, for
    both forms, and ``set_linear_gelu`` after the rewrite changes the form where it now is."""
    torch.manual_seed(0)
    fused = apply_encoder_dtype(WhisperForConditionalGeneration(CFG).eval(), "fp8")
    layers = fused.model.encoder.layers
    assert all(lay.linear_gelu is linear_only and lay.fc2.input_gelu == "exact"
               for lay in layers)
    unfused = copy.deepcopy(fused)
    mel = torch.randn(2, 80, 3000)
    for mode in ("exact", "tanh"):
        assert set_linear_gelu(fused, mode) == CFG.encoder_layers
        assert all(lay.fc2.input_gelu == mode and lay.linear_gelu is linear_only
                   for lay in layers)
        for lay in unfused.model.encoder.layers:  # the arrangement before the move
            lay.fc2.input_gelu, lay.linear_gelu = None, LINEAR_GELU[mode]
        with torch.no_grad():
            assert torch.equal(fused.model.encoder(mel), unfused.model.encoder(mel))


def test_fp8_start_up_errors(monkeypatch):
    with pytest.raises(ValueError, match="choose one"):
        check_fp8("fp8", "auto", "int8", CPU, "torch", torch.float32)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        check_fp8("auto", "fp8", "none", CPU, "triton", torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        check_fp8("auto", "fp16", "none", CPU, "torch", torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # an A100
    with pytest.raises(ValueError, match=r"compute capability 8.9\+.*has 8.0"):
        check_fp8("fp8", "auto", "none", torch.device("cuda"), "triton", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100
    check_fp8("fp8", "fp8", "none", torch.device("cuda"), "triton", torch.bfloat16)
    with pytest.raises(ValueError, match="use --dtype bfloat16"):
        check_fp8("fp8", "auto", "none", torch.device("cuda"), "triton", torch.float16)
    with pytest.raises(ValueError, match="choose one"):
        build_engine(encoder_dtype="fp8", quantization="int8", device="cpu")


# Measured (benchmarks/fp8_accuracy.py, RESULTS.md 'fp8'): on these bundled clips every fp8
# mode gives tiny.en's default tokens (encoder fp8, KV fp8 and both).
CLIPS = ["tests/data/jfk.wav", "tests/data/librivox_0870.wav", "tests/data/cards_005.wav"]


def test_fp8_keeps_tiny_en_tokens_on_the_bundled_clips():
    default = transcribe(build_engine(page_size="16"), CLIPS)
    engine = build_engine(page_size="16", encoder_kv="aligned", encoder_dtype="fp8",
                    kv_cache_dtype="fp8")
    assert engine.pools.kv_pool.k_buffers[0].dtype == FP8
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) == 4 * 4
    results = transcribe(engine, CLIPS, word_timestamps=True)
    tokens = [[[t for s in r.segments for t in s.tokens] for r in rs] for rs in (default, results)]
    assert tokens[0] == tokens[1] and all(tokens[0])
    assert all(r.words for r in results)  # the alignment read the fp8 cross K


def _rounded(lin: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    """A float32 copy of ``lin`` whose weight and bias went through ``dtype``."""
    out = nn.Linear(lin.in_features, lin.out_features)
    out.load_state_dict({k: v.to(dtype).float() for k, v in lin.state_dict().items()})
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an fp8 GPU")
def test_scaled_mm_matches_the_emulation_and_the_engine_runs(tmp_path):
    """On Hopper: ``torch._scaled_mm`` computes the emulated product (same rounding; only the
    accumulation order differs), and the engine runs with both fp8 options (random weights;
    the token agreement is printed)."""
    torch.manual_seed(0)
    lin = nn.Linear(384, 1536)
    x = torch.randn(3000, 384)
    bf16 = torch.bfloat16
    with torch.no_grad():  # the emulation gets the GPU path's bf16-rounded weights and inputs
        emulated = Fp8Linear(_rounded(lin, bf16))(x.to(bf16).float())
        gpu = Fp8Linear(lin.cuda().to(bf16))(x.cuda().to(bf16)).float().cpu()
    assert float((gpu - emulated).norm() / emulated.norm()) < 1e-2  # bf16 output rounding
    folder = str(make_random_whisper(tmp_path))
    gen = torch.Generator().manual_seed(0)
    reqs = [GenerateRequest([50257, 50362], torch.randn(80, 3000, generator=gen),
                            SamplingParams(max_new_tokens=20, ignore_eos=True))
            for _ in range(4)]
    base = build_engine(model=folder, device="cuda", page_size="128").generate(reqs)
    fp8 = build_engine(model=folder, device="cuda", page_size="128", encoder_dtype="fp8",
                 kv_cache_dtype="fp8").generate(
        [GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling) for r in reqs])
    same = sum(a == b for x, y in zip(base, fp8, strict=True)
               for a, b in zip(x.token_ids, y.token_ids, strict=True))
    print(f"fp8 vs bf16, random weights: {same}/{4 * 20} tokens equal")
    assert all(o.error is None and len(o.token_ids) == 20 for o in fp8)
