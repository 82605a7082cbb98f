"""The Whisper encoder's residual stream stays contiguous (the layout fix of issue 19) and gives
the same numbers as the previous, transposed-layout forward; ``compile_layers`` compiles one
graph for all layers and batch sizes >= 2 and gives the eager outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from edserve.models.whisper_config import WhisperConfig
from edserve.models.whisper_encoder import WhisperEncoder

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
    so the residual stream kept the conv's [N, d, S] memory layout through every layer."""
    x = F.gelu(enc.conv2(F.gelu(enc.conv1(mel)))).transpose(1, 2)
    x = x + enc.embed_positions.weight[: x.shape[1]]
    assert not x.is_contiguous()
    for layer in enc.layers:
        x = layer(x)
    return enc.layer_norm(x)


def test_residual_stream_is_contiguous_and_output_unchanged(encoder):
    seen = []
    hooks = [layer.register_forward_hook(
        lambda _m, args, out: seen.append((args[0].is_contiguous(), out.is_contiguous())))
        for layer in encoder.layers]
    try:
        with torch.inference_mode():
            ours = encoder(_mel(3))
    finally:
        for h in hooks:
            h.remove()
    with torch.inference_mode():
        ref = _transposed_layout_forward(encoder, _mel(3))
    assert seen == [(True, True)] * CFG.encoder_layers
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
