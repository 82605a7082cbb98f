"""Encoder CUDA graphs (``--encoder-cuda-graph-max-bs``): the captured sizes, the invariant the
padded replays rely on (a clip's encoder output does not depend on the other rows of its batch,
even NaN ones), start-up errors; on a GPU, the engine's tokens with and without graphs."""

from __future__ import annotations

import pytest
import torch

from edserve.config import EngineConfig
from edserve.models.encoder_graphs import encoder_graph_sizes
from edserve.models.whisper_config import WhisperConfig
from edserve.models.whisper_encoder import WhisperEncoder
from edserve.runtime import build_engine


def test_captured_sizes():
    assert encoder_graph_sizes(1) == [1]
    assert encoder_graph_sizes(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert encoder_graph_sizes(12) == list(range(1, 13))
    with pytest.raises(ValueError):
        encoder_graph_sizes(0)


def test_rows_never_mix_in_the_encoder():
    cfg = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2,
                        encoder_ffn_dim=64, decoder_layers=1, decoder_attention_heads=2,
                        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=20,
                        max_target_positions=16, vocab_size=50)
    torch.manual_seed(0)
    enc = WhisperEncoder(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    mel = torch.randn(4, 8, 40, generator=gen)
    stale = mel.clone()
    stale[2:] = float("nan")  # rows a padded replay carries from an earlier batch
    stale[1] = 1e4
    with torch.inference_mode():
        a, b = enc(mel), enc(stale)
    assert torch.equal(a[0], b[0])
    assert torch.isnan(b[2:]).all()  # the garbage stayed in its own rows


def test_start_up_errors(random_whisper):
    with pytest.raises(ValueError, match="encoder-cuda-graph-max-bs must be >= 0"):
        EngineConfig(encoder_cuda_graph_max_bs=-1)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig(encoder_cuda_graph_max_bs=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_engine(model=str(random_whisper), device="cpu", max_running_requests=1,
                     encoder_cuda_graph_max_bs=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_encoder", [False, True])
def test_engine_tokens_with_encoder_graphs(random_whisper, compile_encoder):
    from edserve.engine.logits_filter import LogitsRecorder
    from edserve.engine.request import GenerateRequest, SamplingParams

    gen = torch.Generator().manual_seed(4)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(6)]

    def run(max_bs: int):
        engine = build_engine(model=str(random_whisper), device="cuda", dtype="float32",
                              max_running_requests=6, encoder_cuda_graph_max_bs=max_bs,
                              compile_encoder=compile_encoder and max_bs > 0)
        assert (engine.model.encoder_graphs is not None) == (max_bs > 0)
        out = []
        for group in (mels[:1], mels[1:4], mels[:6]):  # graph 1, graph 4 (one stale row), eager
            recs = [LogitsRecorder() for _ in group]
            res = engine.generate([GenerateRequest([50257, 50362], m, SamplingParams(
                max_new_tokens=4, ignore_eos=True), logits_processors=[r])
                for m, r in zip(group, recs, strict=True)])
            out.append(([o.token_ids for o in res], [torch.stack(r.rows) for r in recs]))
        return out

    for (tokens, logits), (ref_tokens, ref_logits) in zip(run(4), run(0), strict=True):
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
