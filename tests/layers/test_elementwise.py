"""Row-wise op sets: chosen by the batch's attention ops; the torch reference vs float64."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from edserve.layers.elementwise import TORCH_OPS, elementwise_ops, rms_norm_torch


def _batch(ops_name: str | None):
    backend = None if ops_name is None else SimpleNamespace(ops=SimpleNamespace(name=ops_name))
    return SimpleNamespace(attn_backend=backend)


def test_ops_follow_the_attention_ops():
    assert elementwise_ops(_batch("torch")) is TORCH_OPS
    assert elementwise_ops(_batch(None)) is TORCH_OPS  # no backend: the reference
    triton_ops = elementwise_ops(_batch("triton"))
    assert triton_ops.name == "triton"
    assert triton_ops.rms_norm.__module__ == "edserve.kernels.norm_act"


def test_rms_norm_torch_rounds_before_the_weight():
    x = torch.randn(4, 32, dtype=torch.float64)
    w = torch.rand(32, dtype=torch.float64) + 0.5
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    # computed in fp32 whatever the input (as HF)
    torch.testing.assert_close(rms_norm_torch(x, w, 1e-5), ref, atol=1e-6, rtol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    h = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(rms_norm_torch(xb, wb, 1e-5), wb * h)
