"""FlashAttention-3 through its C entry point vs a float64 reference (GPU, with the library
``EDSERVE_FA3_LIB`` names), and its refusals everywhere (CPU included).

q/k/v are strided views of one fused qkv tensor (the encoders' layout); the output goes into a
NaN-poisoned slice of a larger buffer: every element of the slice must be written and nothing
outside it touched. Shapes: Whisper large-v3's (20 x 64, 1500 tokens) and the 11B vision
tower's grouped plan (16 x 80 in FA3's 96 kernel, fewer keys than queries and the reverse).
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_oracle import fused_qkv, reference

from edserve.kernels import fa3_attention as fa3
from edserve.layers.encoder_attention import resolve_encoder_attention

needs_fa3 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
    or not os.environ.get(fa3.ENV),
    reason=f"needs a Hopper GPU and {fa3.ENV} (tools/build_fa3.sh)")


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("B,H,L,D,qa,nk", [
    (2, 20, 1500, 64, 0, 1500),     # Whisper large-v3's encoder
    (1, 16, 6432, 80, 0, 6432),     # a 4-tile image
    (2, 16, 6432, 80, 0, 1601),     # more queries than keys
    (2, 16, 6432, 80, 1601, 1601),  # a 1-tile image's padding queries over its real keys
    (3, 2, 45, 32, 5, 37),          # partial blocks everywhere, a small head dim
])
def test_matches_float64(B, H, L, D, qa, nk):
    q, k, v = fused_qkv(B, L, H, D, torch.bfloat16)
    qs, ks, vs = q[:, :, qa:], k[:, :, :nk], v[:, :, :nk]
    buf = torch.full((B, L + 4, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = fa3.fa3_attention(qs, ks, vs, out=buf[:, qa:L])
    assert out.data_ptr() == buf[:, qa:L].data_ptr()
    r = 1  # the float64 scores of one batch item
    torch.testing.assert_close(out[:r].double(), reference(qs[:r], ks[:r], vs[:r], D ** -0.5),
                               atol=2e-2, rtol=2e-2)
    assert buf[:, :qa].isnan().all() and buf[:, L:].isnan().all()  # nothing outside written
    again = fa3.fa3_attention(qs, ks, vs)  # allocates; the same bits
    assert again.is_contiguous() and torch.equal(again, out)


@pytest.mark.gpu
@needs_fa3
def test_empty_queries_and_no_keys():
    q, k, v = fused_qkv(1, 20, 2, 64, torch.bfloat16)
    assert fa3.fa3_attention(q[:, :, :0], k, v).shape == (1, 0, 2, 64)
    assert fa3.fa3_attention(q, k[:, :, :0], v[:, :, :0]).eq(0).all()


@pytest.mark.gpu
@needs_fa3
def test_rejects_what_the_kernel_cannot_read():
    q, k, v = fused_qkv(1, 8, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        fa3.fa3_attention(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="head dim"):
        fa3.fa3_attention(q[..., :60], k[..., :60], v[..., :60])
    with pytest.raises(ValueError, match="16-byte"):
        odd = torch.zeros(1, 2, 8 * 2 + 64, dtype=torch.bfloat16, device="cuda")
        odd = odd.as_strided((1, 2, 8, 64), (0, 2, 2, 1))
        fa3.fa3_attention(odd, odd, odd)
    with pytest.raises(ValueError, match="out must be"):
        fa3.fa3_attention(q, k, v, out=torch.empty(1, 8, 2, 32, dtype=torch.bfloat16,
                                                   device="cuda"))


def test_refuses_without_cuda_or_library(monkeypatch):
    q, k, v = fused_qkv(1, 8, 2, 64, torch.bfloat16)
    if q.device.type == "cpu":
        with pytest.raises(ValueError, match="needs CUDA"):
            fa3.fa3_attention(q.cpu(), k.cpu(), v.cpu())
        assert "needs CUDA" in fa3.fa3_unsupported(torch.device("cpu"), torch.bfloat16, 64)
    with pytest.raises(ValueError, match="must be"):
        fa3.fa3_attention(q[0], k, v)  # 3-D q
    with pytest.raises(ValueError, match="with q's B, H, D"):
        fa3.fa3_attention(q, k[:, :1], v[:, :1])  # fewer heads in k/v
    monkeypatch.setattr(fa3, "_lib", None)
    monkeypatch.delenv(fa3.ENV, raising=False)
    with pytest.raises(RuntimeError, match=fa3.ENV):
        fa3.fa3_library()
    monkeypatch.setenv(fa3.ENV, "/nonexistent/libedserve_fa3.so")
    with pytest.raises(RuntimeError, match="does not load"):
        fa3.fa3_library()
    with pytest.raises(ValueError, match="--encoder-attention fa3 needs CUDA"):
        resolve_encoder_attention("fa3", torch.device("cpu"), torch.bfloat16, 64, False)
