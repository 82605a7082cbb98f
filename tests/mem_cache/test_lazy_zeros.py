"""lazy_zeros: zero, writable, aligned, owning host buffers (``torch.zeros`` elsewhere)."""

import pytest
import torch

from edserve.mem_cache.lazy_zeros import ALIGN, lazy_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.int64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (4097, 2, 64)])
def test_zero_aligned_writable(shape, dtype):
    t = lazy_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and t.data_ptr() % ALIGN == 0
    assert torch.equal(t.float(), torch.zeros(shape))
    flat = t.view(-1)
    flat[-1] = 1
    flat[0] = 2
    assert flat[0].float().item() == 2 and t.float().sum().item() == (3 if t.numel() > 1 else 2)


def test_buffers_are_independent():
    a, b = lazy_zeros((1024, 64), torch.float32), lazy_zeros((1024, 64), torch.float32)
    a.fill_(1)
    assert b.abs().sum().item() == 0
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_outlives_every_other_reference():
    t = lazy_zeros((8, 8), torch.float32)[2:]
    import gc
    gc.collect()
    t += 1  # the NumPy block stays alive through the tensor
    assert t.sum().item() == 48


def test_meta_device_is_torch_zeros():
    t = lazy_zeros((2, 3), torch.float32, "meta")
    assert t.device.type == "meta" and t.shape == (2, 3)
