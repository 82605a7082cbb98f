"""The Whisper encoder's residual stream stays contiguous (the layout fix of issue 19) and gives
the same numbers as the previous, transposed-layout forward; ``compile_layers`` compiles one
graph for all layers and batch sizes >= 2 and gives the eager outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from edserve.layers.add_norm import TORCH_ADD_NORM, TRITON_ADD_NORM, AddNormOps
from edserve.models.whisper_config import WhisperConfig
from edserve.models.whisper_encoder import WhisperEncoder, run_unfused_layer

CFG = WhisperConfig(d_model=32, encoder_layers=3, encoder_attention_heads=2, encoder_ffn_dim=128,
                    decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=128,
                    num_mel_bins=8, max_source_positions=20, max_target_positions=16,
                    vocab_size=50)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    enc = WhisperEncoder(CFG).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0, 0.2)
    return enc


def _mel(n: int) -> torch.Tensor:
    return torch.randn(n, CFG.num_mel_bins, 2 * CFG.max_source_positions,
                       generator=torch.Generator().manual_seed(n))


def _transposed_layout_forward(enc: WhisperEncoder, mel: torch.Tensor) -> torch.Tensor:
    """The forward before the fix: the positions added to the conv output's transposed view,
    so the residual stream kept the conv's [N, d, S] memory layout through every layer (and
    every add was its own op, before the add + norm fusion)."""
    x = F.gelu(enc.conv2(F.gelu(enc.conv1(mel)))).transpose(1, 2)
    x = x + enc.embed_positions.weight[: x.shape[1]]
    assert not x.is_contiguous()
    for layer in enc.layers:
        x = run_unfused_layer(layer, x)
    return enc.layer_norm(x)


def test_residual_stream_is_contiguous_and_output_unchanged(encoder):
    seen = []
    hooks = [layer.register_forward_hook(
        lambda _m, args, out: seen.append((args[0].is_contiguous(), out[0].is_contiguous(),
                                           out[1].is_contiguous())))
        for layer in encoder.layers]
    try:
        with torch.inference_mode():
            ours = encoder(_mel(3))
    finally:
        for h in hooks:
            h.remove()
    with torch.inference_mode():
        ref = _transposed_layout_forward(encoder, _mel(3))
    assert seen == [(True, True, True)] * CFG.encoder_layers
    assert ours.shape == (3, CFG.max_source_positions, CFG.d_model) and ours.is_contiguous()
    assert torch.equal(ours, ref)


def test_compiled_layers_share_one_graph_and_match_eager(encoder):
    with torch.inference_mode():
        ref = {n: encoder(_mel(n)) for n in (2, 3, 5, 1)}
    counter = CompileCounterWithBackend("aot_eager")
    encoder.compile_layers(backend=counter)
    try:
        with torch.inference_mode():
            got = {n: encoder(_mel(n)) for n in (2, 3, 5)}
            assert counter.frame_count == 1  # every layer, every batch size >= 2: one graph
            got[1] = encoder(_mel(1))
    finally:
        encoder.uncompile_layers()
    assert counter.frame_count == 2  # batch 1 is specialised
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-6, atol=1e-6)
    assert not encoder.compiled


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_add_norm_kernel_gives_the_eager_output(encoder, dtype, tol):
    """The layer loop with the Triton add + LayerNorm (interpreter on CPU): every add fused
    into the next norm, the last into the final norm; the torch ops' output within fp32 /
    bf16 rounding. The torch set is what the encoder picks on CPU."""
    pytest.importorskip("triton")
    calls = []

    def counted(norm, x, delta=None, gate=None):
        calls.append(delta is not None)
        return TRITON_ADD_NORM.add_layer_norm(norm, x, delta, gate)

    enc = encoder.to(dtype)
    mel = _mel(2).to(dtype)
    try:
        with torch.inference_mode():
            ref = enc(mel)
            enc.add_norm = TORCH_ADD_NORM
            assert torch.equal(enc(mel), ref)
            enc.add_norm = AddNormOps("counted", counted)
            got = enc(mel)
    finally:
        enc.add_norm = None
        encoder.float()
    # one plain norm (layer 0), then every norm adds: 2 per layer + the final one
    assert calls == [False] + [True] * (2 * CFG.encoder_layers)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def _greedy(engine, mels):
    from edserve.engine.logits_filter import LogitsRecorder
    from edserve.engine.request import GenerateRequest, SamplingParams

    recs = [LogitsRecorder() for _ in mels]
    outs = engine.generate([GenerateRequest([50257, 50362], m, SamplingParams(
        max_new_tokens=4, ignore_eos=True), logits_processors=[r])
        for m, r in zip(mels, recs, strict=True)])
    return [o.token_ids for o in outs], [torch.stack(r.rows).float().cpu() for r in recs]


def test_engine_with_compile_encoder_gives_the_eager_tokens(random_whisper):
    """``--compile-encoder`` through build_engine; the graph is rebuilt with the aot_eager
    backend (inductor's CPU C++ compile takes minutes on CI machines; the GPU test below runs
    inductor): the same tokens and logits as the eager engine, one graph for both layers."""
    from edserve.runtime import build_engine

    gen = torch.Generator().manual_seed(2)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(2)]
    eager = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2)
    ref_tokens, ref_logits = _greedy(eager, mels)
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                          compile_encoder=True)
    encoder = engine.model.model.encoder
    assert encoder.compiled
    counter = CompileCounterWithBackend("aot_eager")
    encoder.compile_layers(backend=counter)
    tokens, logits = _greedy(engine, mels)
    assert counter.frame_count == 1
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_encoder_refuses_tensor_parallel():
    from edserve.config import EngineConfig

    with pytest.raises(ValueError, match="--compile-encoder"):
        EngineConfig(compile_encoder=True, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compiled_encoder_on_gpu(random_whisper):
    from edserve.runtime import build_engine

    gen = torch.Generator().manual_seed(2)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(3)]
    runs = [_greedy(build_engine(model=str(random_whisper), device="cuda", dtype="float32",
                                 max_running_requests=3, compile_encoder=c), mels)
            for c in (False, True)]
    assert runs[1][0] == runs[0][0]
    for a, b in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_add_norm_matches_torch_ops():
    """On CUDA the encoder picks the Triton add + LayerNorm; at tiny.en's width (384, not a
    power of two) and 1500 positions its output is the separate torch ops' within fp32
    rounding, and within bf16 rounding in bf16."""
    from edserve.layers.add_norm import add_norm_ops

    cfg = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6,
                        encoder_ffn_dim=1536, decoder_layers=1, decoder_attention_heads=6,
                        decoder_ffn_dim=1536, num_mel_bins=80, max_source_positions=1500,
                        max_target_positions=16, vocab_size=50)
    torch.manual_seed(0)
    enc = WhisperEncoder(cfg).eval().cuda()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0, 0.05)
    mel = torch.randn(3, 80, 3000, device="cuda")
    assert add_norm_ops(mel).name == "torch"  # gradients recorded: no kernel
    with torch.inference_mode():
        assert add_norm_ops(mel).name == "triton"
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        enc.to(dtype)
        with torch.inference_mode():
            got = enc(mel.to(dtype))
            enc.add_norm = TORCH_ADD_NORM
            ref = enc(mel.to(dtype))
            enc.add_norm = None
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < tol, (dtype, err)
