"""Triton attention through TMA descriptors vs a float64 reference (CPU: the Triton interpreter).

q/k/v are strided views of one fused qkv tensor laid out as the Whisper encoder's
(``[B, L, 3, H, D]`` permuted); the output goes into a NaN-poisoned slice of a larger buffer:
every element of the slice must be written (rows past a partial q block are clipped by the
descriptor) and nothing outside it touched.
"""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.tma_attention import TmaTiles, tma_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
needs_tma = pytest.mark.skipif(DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9,
                               reason="TMA descriptors need compute capability 9.0+")


def reference(q, k, v, scale):
    """float64 ``softmax(q k^T scale) v``: [B, H, Lq, D] -> [B, Lq, H, D]."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.double()).transpose(1, 2)


def fused_qkv(B, L, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, L, 3, H, D, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    return qkv.permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, D] views, strides of the fused layout


@needs_tma
@pytest.mark.parametrize("D,halves", [(64, 1), (32, 1), (64, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(D, halves, dtype):
    B, H, L = 2, 3, 45  # 40 queries (a partial 32-row block), 37 keys (a partial 16-key block)
    q, k, v = fused_qkv(B, L, H, D, dtype)
    qs, ks, vs = q[:, :, 5:], k[:, :, :37], v[:, :, :37]
    buf = torch.full((B, L + 4, H, D), float("nan"), dtype=dtype, device=DEV)
    out = tma_attention(qs, ks, vs, out=buf[:, 5:L], tiles=TmaTiles(32, 16, 4, 2, halves))
    assert out.data_ptr() == buf[:, 5:L].data_ptr()
    torch.testing.assert_close(out.double().cpu(), reference(qs, ks, vs, D ** -0.5).cpu(),
                               atol=3e-2, rtol=3e-2)
    assert buf[:, :5].isnan().all() and buf[:, L:].isnan().all()  # nothing outside written


@needs_tma
def test_allocates_output_custom_scale_and_no_keys():
    q, k, v = fused_qkv(1, 20, 2, 16, torch.bfloat16, seed=1)
    out = tma_attention(q, k, v, scale=0.3, tiles=TmaTiles(16, 16, 4, 2))
    assert out.shape == (1, 20, 2, 16)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, 0.3).cpu(), atol=3e-2,
                               rtol=3e-2)
    assert tma_attention(q, k[:, :, :0], v[:, :, :0]).eq(0).all()


def test_rejects_what_tma_cannot_read():
    q, k, v = fused_qkv(1, 8, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        tma_attention(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="share one of"):
        tma_attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="16-byte"):  # rows 2 elements apart: 4-byte stride
        odd = torch.zeros(1, 2, 8 * 2 + 64, dtype=torch.bfloat16, device=DEV)
        odd = odd.as_strided((1, 2, 8, 64), (0, 2, 2, 1))
        tma_attention(odd, odd, odd)
    with pytest.raises(ValueError, match="out must be"):
        tma_attention(q, k, v, out=torch.empty(1, 8, 2, 32, dtype=torch.bfloat16, device=DEV))


@pytest.mark.gpu
@needs_tma
@pytest.mark.skipif(DEV != "cuda", reason="CUDA only")
def test_whisper_encoder_shape_matches_sdpa():
    """At large-v3's encoder shape (20 x 64, 1500 tokens) the kernel agrees with SDPA as
    closely as SDPA's bf16 result agrees with float64."""
    q, k, v = fused_qkv(2, 1500, 20, 64, torch.bfloat16)
    want = reference(q, k, v, 64 ** -0.5)
    got = tma_attention(q, k, v).double()
    got2 = tma_attention(q, k, v, tiles=TmaTiles(128, 64, 8, 3, halves=2)).double()
    err = max((got - want).abs().max().item(), (got2 - want).abs().max().item())
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).double()
    sdpa_err = (sdpa - want).abs().max().item()
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
