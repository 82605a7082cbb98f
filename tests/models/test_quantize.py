"""int8 dynamic quantization transform (edserve.models.quantize) on a small random Whisper."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edserve.models.quantize import check_supported, quantize_model, supports
from edserve.models.weights.fused import FusedLinear
from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration

CFG = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                    encoder_ffn_dim=256, decoder_layers=2, decoder_attention_heads=4,
                    decoder_ffn_dim=256, num_mel_bins=80, max_source_positions=1500,
                    max_target_positions=448, vocab_size=51864)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    fp32 = WhisperForConditionalGeneration(CFG).eval()
    return fp32, quantize_model(copy.deepcopy(fp32), "int8")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_every_linear_is_int8(models):
    _, q = models
    names = {n for n, m in q.named_modules() if isinstance(m, nn.Linear)}
    assert names == set()  # the stacked float cross k/v too: per-layer int8 modules instead
    assert q.model.decoder.cross_kv_proj is None
    dyn = [m for _, m in q.named_modules()
           if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    # per encoder layer: qkv, out, fc1, fc2; per decoder layer: + cross q, cross out, cross
    # k|v; + logits
    assert len(dyn) == 4 * CFG.encoder_layers + 7 * CFG.decoder_layers + 1
    assert q.quantization == {"mode": "int8", "linears": len(dyn) - 1}
    qkv = q.model.encoder.layers[0].self_attn.qkv_proj
    assert [p for p, _ in qkv.parts] == ["q_proj", "k_proj", "v_proj"]  # FusedLinear layout
    assert not isinstance(qkv, FusedLinear)


def test_int8_outputs_close_to_fp32(models):
    fp32, q = models
    torch.manual_seed(1)
    mel = torch.randn(CFG.num_mel_bins, 3000)
    with torch.inference_mode():
        e32, e8 = fp32.encode([mel])[0], q.encode([mel])[0]
        assert _rel(e8, e32) < 0.05
        hidden = torch.randn(5, CFG.d_model)
        l32, l8 = fp32.compute_logits(hidden), q.compute_logits(hidden)
    assert l8.shape == l32.shape == (5, CFG.vocab_size)
    assert _rel(l8, l32) < 0.05
    with torch.inference_mode():  # the per-layer int8 cross k/v against the stacked float GEMM
        for (k32, v32), (k8, v8) in zip(fp32.model.decoder.cross_kv(e32),
                                        q.model.decoder.cross_kv(e32), strict=True):
            assert k8.shape == k32.shape and v8.shape == v32.shape
            assert _rel(k8, k32) < 0.05 and _rel(v8, v32) < 0.05
    # the per-row weight scales keep the ranking: top-1 of each row among fp32's top-5
    top5 = l32.topk(5, dim=-1).indices
    assert all(int(a) in set(t.tolist()) for a, t in zip(l8.argmax(-1), top5, strict=True))


def test_none_is_identity_and_other_models_are_refused(models):
    fp32, _ = models
    assert quantize_model(fp32, "none") is fp32
    assert supports(fp32) and not supports(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Whisper models only"):
        quantize_model(nn.Sequential(nn.Linear(2, 2)), "int8")


@pytest.mark.parametrize(("mode", "device", "dtype", "match"), [
    ("int4", "cpu", torch.float32, "must be one of"),
    ("int8", "cuda", torch.float32, "CPU only"),
    ("int8", "cpu", torch.bfloat16, "--dtype float32"),
])
def test_unsupported_combinations_are_clear_errors(mode, device, dtype, match):
    with pytest.raises(ValueError, match=match):
        check_supported(mode, torch.device(device), dtype)


def test_supported_combinations_pass():
    check_supported("none", torch.device("cuda"), torch.bfloat16)
    check_supported("int8", torch.device("cpu"), torch.float32)


def test_int8_linear_fast_path_equals_the_torch_module():
    """Int8Linear.eager calls the op (the dispatcher's boxed call) with the cached packed
    weight: bit-identical to torch.ao's DynamicQuantizedLinear.forward, also after a deep copy
    (its own weight)."""
    import copy

    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from edserve.models.quantize import int8_linear

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    q = int8_linear(w, b)
    x = torch.randn(5, 32, generator=gen) * 3
    want = DynamicLinear.forward(q, x)
    assert torch.equal(q.eager(x), want) and torch.equal(q(x), want)
    clone = copy.deepcopy(q)
    assert clone.handle != q.handle and torch.equal(clone(x), want)
    assert _rel(want, x @ w.T + b) < 0.03  # it is the linear (int8 rounding)


def test_the_opaque_op_calls_the_direct_function_which_goes_with_its_module():
    """Inside a compiled graph the opaque op calls an int8 linear's ``direct`` function (no
    module lookup): equal to ``eager``; it holds the packed weight, not the module, and leaves
    the table when the module is collected."""
    import gc

    from edserve.models import opaque_linear
    from edserve.models.quantize import int8_linear

    gen = torch.Generator().manual_seed(1)
    q = int8_linear(torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    handle = q.handle
    assert handle in opaque_linear._DIRECT
    assert torch.equal(torch.ops.edserve.opaque_linear(x, handle, 48), q.eager(x))
    del q
    gc.collect()
    assert handle not in opaque_linear._DIRECT and handle not in opaque_linear._LIVE
