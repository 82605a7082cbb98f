"""``host_copy``: the fast list packing gives ``torch.tensor``'s values, dtype and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edserve.engine.host_copy import host_tensor, to_device


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8, torch.float64, torch.float32])
def test_host_tensor_equals_torch_tensor(dtype):
    values = [0, 1, 7, 100, True, False]
    if dtype.is_floating_point:
        values += [0.5, -2.25, float("inf"), 1e-3]
    elif dtype != torch.uint8:
        values += [-1, -100]
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_host_tensor_edges():
    assert host_tensor([], torch.int64).shape == (0,)
    assert host_tensor((3, np.int64(4)), torch.int64).tolist() == [3, 4]  # tuples, numpy ints
    big = [2 ** 63 - 1, -2 ** 63]
    assert host_tensor(big, torch.int64).tolist() == big
    # what the array module refuses goes through torch.tensor, with its semantics ...
    assert host_tensor([1.5, 2.7], torch.int64).tolist() == torch.tensor(
        [1.5, 2.7], dtype=torch.int64).tolist()
    # ... and its errors
    with pytest.raises(TypeError):
        host_tensor([1, None], torch.int64)
    nan = host_tensor([float("nan")], torch.float32)
    assert torch.isnan(nan).all()


def test_to_device_cpu_values_and_independence():
    values = list(range(1000))
    out = to_device(values, torch.int64, torch.device("cpu"))
    assert out.tolist() == values
    values[0] = 99  # the tensor does not alias the caller's list
    assert out[0].item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_cuda_is_pinned_and_async():
    dev = torch.device("cuda")
    values = list(range(5000))
    out = to_device(values, torch.int64, dev)
    assert out.device.type == "cuda" and out.cpu().tolist() == values
    assert to_device([0.5, 1.5], torch.float32, dev).cpu().tolist() == [0.5, 1.5]
