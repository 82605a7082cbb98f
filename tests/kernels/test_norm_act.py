"""Triton RMSNorm and SiLU-and-multiply (CPU interpreter without CUDA) vs float64 references
and the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.norm_act import rms_norm, silu_mul  # noqa: E402
from edserve.layers.elementwise import rms_norm_torch, silu_mul_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _ref_rms(x, w, eps):
    x64 = x.double()
    return w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64), (5, 4, 24), (1, 100), (0, 32)], ids=str)
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype)
    got = rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), _ref_rms(x, w, 1e-5), atol=TOL[dtype],
                               rtol=TOL[dtype])
    want = rms_norm_torch(x, w, 1e-5)  # the torch op it replaces: same rounding points
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_strided_rows():
    x = torch.randn(6, 80, device=DEVICE)[:, 8:72]  # rows 80 apart, 64 wide
    w = torch.rand(64, device=DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), _ref_rms(x, w, 1e-6),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,n", [(4, 48), (2, 1500), (0, 8)])
def test_silu_mul_views_of_one_gemm(dtype, T, n):
    g0 = torch.Generator().manual_seed(T * n)
    gu = (torch.randn(T, 2 * n, generator=g0) * 4).to(DEVICE, dtype)
    gate, up = gu[:, :n], gu[:, n:]  # row stride 2n: no copy
    got = silu_mul(gate, up)
    g64, u64 = gate.double(), up.double()
    ref = g64 * torch.sigmoid(g64) * u64
    assert got.shape == (T, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])
    torch.testing.assert_close(got, silu_mul_torch(gate, up), atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_inputs_raise():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), torch.ones(2, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="g and u"):
        silu_mul(x, x[:, :4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_matches_torch_ops():
    """Compiled on the GPU, at the 11B text widths: within a bf16 rounding or two of the torch
    ops (they round at the same points; only fp32 rsqrt/exp may differ)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(72, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
    got, want = rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5)
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -6)  # y's ulp, then w * y's
    gu = torch.randn(72, 2 * 14336, device="cuda", generator=g).bfloat16()
    got, want = silu_mul(gu[:, :14336], gu[:, 14336:]), silu_mul_torch(gu[:, :14336],
                                                                       gu[:, 14336:])
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -6)  # silu's ulp, then the product's
