"""Triton rotary embedding (CPU interpreter without CUDA) vs float64 and the torch op."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.rope import rope  # noqa: E402
from edserve.layers.elementwise import rope_torch  # noqa: E402
from edserve.models.mllama.config import RopeConfig  # noqa: E402
from edserve.models.mllama.rope import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _tables(T: int, D: int, dtype):
    emb = RotaryEmbedding(RopeConfig(), D).to(DEVICE)
    return emb(torch.arange(5, 5 + T, device=DEVICE) * 7, dtype)  # [T, 1, D] each


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,H,D", [(3, 4, 16), (2, 20, 32), (0, 2, 8)])
def test_rope_matches_reference(dtype, T, H, D):
    g = torch.Generator().manual_seed(T * H + D)
    qkv = torch.randn(T, (H + 2) * D, generator=g).to(DEVICE, dtype)
    x = qkv[:, :H * D].view(T, H, D)  # a view of a fused GEMM output (row stride (H+2)D)
    cos, sin = _tables(T, D, dtype)
    got = rope(x, cos, sin)
    x64, c64, s64 = x.double(), cos.double(), sin.double()
    ref = x64 * c64 + torch.cat([-x64[..., D // 2:], x64[..., :D // 2]], -1) * s64
    assert got.shape == (T, H, D) and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])
    torch.testing.assert_close(got, rope_torch(x, cos, sin), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype != torch.bfloat16 and DEVICE == "cpu":  # interpreter: the same rounding points,
        # bitwise (its bf16 casts are not round-to-nearest; compiled GPU code contracts
        # x * cos + rot * sin into fused multiply-adds, within TOL of the torch op above)
        assert torch.equal(got, rope_torch(x, cos, sin))


def test_rope_bad_inputs():
    x = torch.randn(2, 3, 8, device=DEVICE)
    cos, sin = _tables(2, 8, torch.float32)
    with pytest.raises(ValueError, match="even D"):
        rope(torch.randn(2, 3, 7, device=DEVICE), cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        rope(x, cos.half(), sin)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_matches_the_torch_op():
    """Compiled on the GPU at the 11B shapes: within one bf16 rounding of the torch op (the
    compiled kernel contracts ``x * cos + rot * sin`` into fused multiply-adds, which round
    once where torch rounds twice) and no further from float64 than the torch op."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(72, 48 * 128, device="cuda", generator=g).bfloat16()
    cos, sin = _tables(72, 128, torch.bfloat16)
    for x in (qkv[:, :4096].view(72, 32, 128), qkv[:, 4096:5120].view(72, 8, 128)):
        got, want = rope(x, cos, sin), rope_torch(x, cos, sin)
        torch.testing.assert_close(got, want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        x64, c64, s64 = x.double(), cos.double(), sin.double()
        ref = x64 * c64 + torch.cat([-x64[..., 64:], x64[..., :64]], -1) * s64
        assert (got.double() - ref).abs().max() <= (want.double() - ref).abs().max() * 1.01
