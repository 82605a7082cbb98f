"""The encoders' add + LayerNorm op sets: the torch set is exactly the separate eager ops; the
choice by device (Triton only where registered, outside autograd)."""

from __future__ import annotations

import pytest
import torch

from edserve.layers import add_norm
from edserve.layers.add_norm import (
    NO_PENDING,
    TORCH_ADD_NORM,
    TRITON_ADD_NORM,
    add_norm_ops,
    add_pending,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_set_is_the_separate_eager_ops(dtype):
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(2, 5, 48, generator=g).to(dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(48, eps=1e-6, dtype=dtype)
    gate = torch.tensor([0.8], dtype=dtype).tanh()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
        for gt in (None, gate):
            summed = x + (delta if gt is None else gt * delta)
            new_x, h = TORCH_ADD_NORM.add_layer_norm(norm, x, delta, gt)
            assert torch.equal(new_x, summed) and torch.equal(h, norm(summed))
            assert torch.equal(add_pending(x, delta, gt), summed)
        new_x, h = TORCH_ADD_NORM.add_layer_norm(norm, x, *NO_PENDING)
        assert new_x is x and torch.equal(h, norm(x))
    assert add_pending(x, *NO_PENDING) is x


def test_ops_chosen_by_device_outside_autograd(monkeypatch):
    x = torch.zeros(2, 8)
    assert add_norm_ops(x) is TORCH_ADD_NORM  # CPU: the eager ops (bit-identical)
    assert add_norm_ops(torch.zeros(2, 8, device="meta")) is TORCH_ADD_NORM
    monkeypatch.setitem(add_norm.ADD_NORM_BY_DEVICE, "cpu", TRITON_ADD_NORM)
    with torch.no_grad():
        assert add_norm_ops(x) is TRITON_ADD_NORM
    with torch.enable_grad():
        assert add_norm_ops(x) is TORCH_ADD_NORM  # the kernel has no backward
    monkeypatch.setattr(add_norm, "triton_available", lambda: False)
    with torch.no_grad():
        assert add_norm_ops(x) is TORCH_ADD_NORM


def test_triton_set_matches_the_torch_set_and_checks_the_norm():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    x, delta = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    norm = torch.nn.LayerNorm(40)
    with torch.no_grad():
        got = TRITON_ADD_NORM.add_layer_norm(norm, x, delta)
        want = TORCH_ADD_NORM.add_layer_norm(norm, x, delta)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="norm over"):
            TRITON_ADD_NORM.add_layer_norm(torch.nn.LayerNorm((3, 40)), x, delta)
