"""Triton attention through TMA descriptors vs a float64 reference (CPU: the Triton interpreter).

q/k/v are strided views of one fused qkv tensor laid out as the Whisper encoder's
(``[B, L, 3, H, D]`` permuted); the output goes into a NaN-poisoned slice of a larger buffer:
every element of the slice must be written (rows past a partial q block are clipped by the
descriptor) and nothing outside it touched.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import DEV, fused_qkv, reference

from edserve.kernels.tma_attention import TmaTiles, tma_attention, tma_chunks

needs_tma = pytest.mark.skipif(DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9,
                               reason="TMA descriptors need compute capability 9.0+")


@needs_tma
@pytest.mark.parametrize("D", [64, 32, 80, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(D, dtype):
    B, H, L = 2, 3, 45  # 40 queries (a partial 32-row block), 37 keys (a partial 16-key block)
    q, k, v = fused_qkv(B, L, H, D, dtype)
    qs, ks, vs = q[:, :, 5:], k[:, :, :37], v[:, :, :37]
    buf = torch.full((B, L + 4, H, D), float("nan"), dtype=dtype, device=DEV)
    out = tma_attention(qs, ks, vs, out=buf[:, 5:L], tiles=TmaTiles(32, 16, 4, 2))
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
        tma_attention(q[..., :40], k[..., :40], v[..., :40])
    assert [tma_chunks(d) for d in (64, 80, 96, 48, 72, 256)] == \
        [(64, 0), (64, 16), (64, 32), (32, 16), None, None]
    big = q.expand(40000, 2, 8, 64)  # a stride-0 batch: 80,000 (batch, head) programs
    with pytest.raises(ValueError, match="exceeds 65535"):
        tma_attention(big, big, big)
    with pytest.raises(ValueError, match="share one of"):
        tma_attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="16-byte"):  # rows 2 elements apart: 4-byte stride
        odd = torch.zeros(1, 2, 8 * 2 + 64, dtype=torch.bfloat16, device=DEV)
        odd = odd.as_strided((1, 2, 8, 64), (0, 2, 2, 1))
        tma_attention(odd, odd, odd)
    if DEV == "cpu":
        import os

        os.environ.pop("TRITON_INTERPRET")
        try:
            with pytest.raises(ValueError, match="runs on CUDA tensors"):
                tma_attention(q, k, v)
        finally:
            os.environ["TRITON_INTERPRET"] = "1"
    with pytest.raises(ValueError, match="out must be"):
        tma_attention(q, k, v, out=torch.empty(1, 8, 2, 32, dtype=torch.bfloat16, device=DEV))


@pytest.mark.gpu
@needs_tma
@pytest.mark.skipif(DEV != "cuda", reason="CUDA only")
@pytest.mark.parametrize("L,H,D", [(1500, 20, 64), (1608, 16, 80), (1632, 16, 80),
                                   (1665, 16, 80), (37, 4, 80), (37, 4, 64)])
def test_encoder_shapes_match_sdpa(L, H, D):
    """At large-v3's encoder shape (20 x 64, 1500 tokens), the 11B vision tower's (16 x 80,
    a 1608-token tile) and key counts whose last 64/128-key block is 32-97 keys short or that
    are shorter than one block, the kernel (default tiles) agrees with float64 as closely as
    SDPA's bf16 result. (The 16-column chunk read partly past the keys' end gave wrong sums on
    the H200 at 6432 and 1601 keys: the last block is now read ending at the last key.)"""
    q, k, v = fused_qkv(2, L, H, D, torch.bfloat16)
    want = reference(q, k, v, D ** -0.5)
    got = tma_attention(q, k, v).double()
    err = (got - want).abs().max().item()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).double()
    sdpa_err = (sdpa - want).abs().max().item()
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
