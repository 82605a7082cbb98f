"""``--encoder-attention``: the sdpa and tma forms of Whisper's encoder self-attention, how
``auto`` resolves, what is refused, and a whole encoder in either form (CPU: the Triton
interpreter runs the tma kernel; GPU: large-v3's layer shape against float64)."""

from __future__ import annotations

import os

import pytest
import torch

from edserve.config import EngineConfig
from edserve.layers.encoder_attention import (
    ENCODER_ATTENTION,
    resolve_encoder_attention,
    sdpa_attend,
    set_encoder_attention,
    tma_attend,
)
from edserve.models.whisper_config import WhisperConfig
from edserve.models.whisper_encoder import WhisperEncoder

CPU = torch.device("cpu")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _encoder(dtype=torch.bfloat16, device="cpu") -> WhisperEncoder:
    cfg = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=2,
                        encoder_ffn_dim=128, decoder_layers=1, decoder_attention_heads=2,
                        decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=24,
                        max_target_positions=8, vocab_size=16)
    torch.manual_seed(0)
    enc = WhisperEncoder(cfg)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return enc.to(device=device, dtype=dtype).eval()


def test_auto_is_sdpa_and_tma_is_refused_off_cuda():
    assert resolve_encoder_attention("auto", CPU, torch.bfloat16, 64, False) == "sdpa"
    assert resolve_encoder_attention("sdpa", CPU, torch.float32, 80, True) == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_encoder_attention("tma", CPU, torch.bfloat16, 64, False)
    with pytest.raises(ValueError, match="must be auto or one of"):
        resolve_encoder_attention("flash", CPU, torch.bfloat16, 64, False)
    assert EngineConfig().encoder_attention == "auto"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="Hopper+ only")
def test_auto_on_cuda_is_sdpa_and_tma_is_refused_where_it_cannot_run():
    from edserve.kernels.fa3_attention import fa3_unsupported

    dev = torch.device("cuda")  # auto: fa3 where its library loads, else sdpa
    fa3 = fa3_unsupported(dev, torch.bfloat16, 64) is None
    assert resolve_encoder_attention("auto", dev, torch.bfloat16, 64, False) == \
        ("fa3" if fa3 else "sdpa")
    assert resolve_encoder_attention("auto", dev, torch.bfloat16, 64, True) == "sdpa"
    assert resolve_encoder_attention("auto", dev, torch.float16, 64, False) == "sdpa"
    with pytest.raises(ValueError, match="float16"):
        resolve_encoder_attention("tma", dev, torch.float32, 64, False)
    with pytest.raises(ValueError, match="head dim"):
        resolve_encoder_attention("tma", dev, torch.bfloat16, 72, False)
    with pytest.raises(ValueError, match="compile-encoder"):
        resolve_encoder_attention("tma", dev, torch.bfloat16, 64, True)


@pytest.mark.skipif(DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9,
                    reason="the tma form needs compute capability 9.0+")
def test_set_reaches_every_encoder_layer_and_the_encoder_agrees_in_either_form():
    enc = _encoder(device=DEV)
    assert all(layer.attend is sdpa_attend for layer in enc.layers)
    mel = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(1))
    mel = mel.to(device=DEV, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = enc(mel).float()
        assert set_encoder_attention(enc, "tma") == 2
        assert all(layer.attend is tma_attend for layer in enc.layers)
        got = enc(mel).float()
    assert got.shape == want.shape == (2, 24, 64)
    # two bf16 computations of one function: the rounding of p and of the outputs differs
    torch.testing.assert_close(got, want, atol=6e-2, rtol=6e-2)
    assert set(ENCODER_ATTENTION) == {"sdpa", "tma", "fa3"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or not os.environ.get("EDSERVE_FA3_LIB"),
                    reason="needs a Hopper GPU and EDSERVE_FA3_LIB (tools/build_fa3.sh)")
def test_fa3_form_agrees_with_sdpa_and_is_refused_under_compile():
    enc = _encoder(device="cuda")
    mel = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(1))
    mel = mel.to(device="cuda", dtype=torch.bfloat16)
    dev = torch.device("cuda")
    assert resolve_encoder_attention("fa3", dev, torch.bfloat16, 32, False) == "fa3"
    with pytest.raises(ValueError, match="compile-encoder"):
        resolve_encoder_attention("fa3", dev, torch.bfloat16, 32, True)
    with torch.inference_mode():
        want = enc(mel).float()
        assert set_encoder_attention(enc, "fa3") == 2
        got = enc(mel).float()
    torch.testing.assert_close(got, want, atol=6e-2, rtol=6e-2)


def test_build_refuses_tma_where_it_cannot_run(tmp_path):
    from whisper_fixtures import make_random_whisper

    from edserve.runtime.build import build_engine

    folder = make_random_whisper(tmp_path / "w")
    with pytest.raises(ValueError, match="--encoder-attention tma needs CUDA"):
        build_engine(EngineConfig(model=str(folder), device="cpu", encoder_attention="tma"))


def test_serve_refuses_fa3_where_it_cannot_run_with_one_line(tmp_path, capsys):
    """``edserve serve --encoder-attention fa3`` on a CPU says why and exits 2 before any
    server starts, as ``edserve transcribe`` does (it was a traceback)."""
    from whisper_fixtures import make_random_whisper

    from edserve.cli import main

    folder = make_random_whisper(tmp_path / "w")
    with pytest.raises(SystemExit) as done:
        main(["serve", "--model", str(folder), "--device", "cpu", "--encoder-attention", "fa3",
              "--port", "0"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "edserve: --encoder-attention fa3 needs CUDA, the device is cpu"
    assert not any("Traceback" in line for line in err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="Hopper+ only")
def test_large_v3_layer_shape_on_gpu_against_float64():
    """One large-v3-shaped attention (20 x 64, 1500 tokens) through both forms: the tma form
    is as close to float64 as cuDNN's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 1500, 3, 20, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ref = ref.transpose(1, 2)
    err_tma = (tma_attend(q, k, v).double() - ref).abs().max().item()
    err_sdpa = (sdpa_attend(q, k, v).double() - ref).abs().max().item()
    assert err_tma <= 2 * err_sdpa + 1e-3, (err_tma, err_sdpa)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="Hopper+ only")
@pytest.mark.parametrize("form", ["tma", "fa3"])
def test_tma_form_inside_encoder_cuda_graphs_equals_its_eager_forward(form):
    """``--encoder-attention tma`` (or ``fa3``) with ``--encoder-cuda-graph-max-bs``: the TMA
    descriptors are built on the host at capture, so a replay must read the graph's static
    input (not the capture-time tensors' contents) and give the eager forward's output (up to
    the GEMMs' choices at another batch size). fa3 launches from its own (static) CUDA runtime
    through ctypes: its kernel must be captured on torch's capture stream too."""
    from edserve.kernels.fa3_attention import fa3_unsupported
    from edserve.models.encoder_graphs import EncoderGraphs

    if form == "fa3" and fa3_unsupported(torch.device("cuda"), torch.bfloat16, 32):
        pytest.skip(fa3_unsupported(torch.device("cuda"), torch.bfloat16, 32))
    enc = _encoder(device="cuda")
    set_encoder_attention(enc, form)
    graphs = EncoderGraphs(enc, 3, (8, 48), torch.bfloat16, torch.device("cuda"))
    gen = torch.Generator().manual_seed(2)
    for n in (1, 2, 3, 2):  # a padded replay (2 in the graph of 3) after a full one
        mel = torch.randn(n, 8, 48, generator=gen).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            want = enc(mel)
            got = graphs.run(mel)
        assert got is not None and got.shape == (n, 24, 64)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
