"""Triton dense bidirectional attention vs a float64 reference (CPU: the Triton interpreter).

q/k/v are strided views of one fused qkv tensor laid out as the vision tower's
(``[B, L, 3, H, D]`` permuted), and the output goes into a NaN-poisoned slice of a larger
buffer, as the vision plan writes it: every element of the slice must be written and nothing
outside it touched.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import DEV, fused_qkv, reference

from edserve.kernels.dense_attention import DenseTiles, dense_attention, head_dim_chunks


@pytest.mark.parametrize("D", [80, 64, 72, 8, 96])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_matches_float64(D, dtype, tol):
    B, H, L = 2, 3, 45  # 45 keys: one whole 32-key block and a partial one
    q, k, v = fused_qkv(B, L, H, D, dtype)
    # query rows [5, 45) only, over keys [0, 37): offset views as the grouped plan uses
    qs, ks, vs = q[:, :, 5:], k[:, :, :37], v[:, :, :37]
    buf = torch.full((B, L + 4, H, D), float("nan"), dtype=dtype, device=DEV)
    out = dense_attention(qs, ks, vs, out=buf[:, 5:L], tiles=DenseTiles(block_m=16, block_n=32))
    want = reference(qs, ks, vs, D ** -0.5)
    assert out.data_ptr() == buf[:, 5:L].data_ptr()
    torch.testing.assert_close(out.double().cpu(), want.cpu(), atol=tol, rtol=tol)
    assert buf[:, :5].isnan().all() and buf[:, L:].isnan().all()  # nothing outside written


def test_allocates_output_and_custom_scale():
    q, k, v = fused_qkv(1, 20, 2, 80, torch.float32, seed=1)
    out = dense_attention(q, k, v, scale=0.3, tiles=DenseTiles(block_m=16, block_n=16))
    assert out.shape == (1, 20, 2, 80)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, 0.3).cpu(), atol=2e-5,
                               rtol=2e-5)


def test_no_keys_gives_zeros():
    q, k, v = fused_qkv(1, 8, 2, 16, torch.float32)
    out = dense_attention(q, k[:, :, :0], v[:, :, :0], tiles=DenseTiles(block_m=16))
    assert out.eq(0).all()


def test_head_dim_chunks():
    assert head_dim_chunks(80) == (64, 16)
    assert head_dim_chunks(64) == (64, 0)
    assert head_dim_chunks(96) == (64, 32)
    assert head_dim_chunks(72) == (64, 16)
    assert head_dim_chunks(8) == (16, 0)
    assert head_dim_chunks(200) == (128, 128)


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v), "must be \\[B, H, L, D\\]"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), "must be \\[B, H, Lk, D\\]"),
    (lambda q, k, v: (q, k.half(), v.half()), "share one of"),
    (lambda q, k, v: (q[..., ::2], k[..., ::2], v[..., ::2]), "unit stride"),
])
def test_bad_inputs_raise(bad, match):
    q, k, v = fused_qkv(1, 8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        dense_attention(*bad(q, k, v))


def test_bad_out_raises():
    q, k, v = fused_qkv(1, 8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        dense_attention(q, k, v, out=torch.empty(1, 2, 8, 16))
