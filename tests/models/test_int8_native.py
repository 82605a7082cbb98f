"""The native int8 linear op (edserve.models.int8_native, csrc/int8_linear.cpp): built with the
machine's compiler into the edserve cache, bit-identical to fbgemm's dynamic linear, clear
errors, weights released with their modules; a failed build leaves the opaque op."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from torch import nn

from edserve.models import int8_native
from edserve.models.catalog import model_cache_dir
from edserve.models.quantize import int8_linear


@pytest.fixture(scope="module")
def built():
    assert int8_native.load(model_cache_dir()), "the native int8 linear did not build"
    return True


def _linear(seed: int, out: int = 48, inp: int = 32, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen)
    return int8_linear(w, torch.randn(out, generator=gen) if bias else None), gen


@pytest.mark.parametrize("shape", [(1, 32), (5, 32), (2, 3, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_native_op_equals_fbgemm_bit_for_bit(built, shape, bias):
    q, gen = _linear(2, bias=bias)
    q.attach_native()
    x = torch.randn(*shape, generator=gen) * 3
    got = int8_native.linear(x, q.native, 48)
    assert got.shape == (*shape[:-1], 48)
    assert torch.equal(got, q.eager(x))


def test_modules_made_after_loading_attach_themselves_and_copies_get_their_own(built):
    q, gen = _linear(3)
    assert q.native is not None  # registered with the library loaded
    clone = copy.deepcopy(q)
    assert clone.native is not None and clone.native != q.native
    x = torch.randn(4, 32, generator=gen)
    assert torch.equal(int8_native.linear(x, clone.native, 48), q.eager(x))


def test_bad_calls_are_clear_errors(built):
    q, gen = _linear(4)
    x = torch.randn(2, 32, generator=gen)
    with pytest.raises(RuntimeError, match="float32 input"):
        int8_native.linear(x.bfloat16(), q.native, 48)
    with pytest.raises(RuntimeError, match="expects 47"):
        int8_native.linear(x, q.native, 47)
    with pytest.raises(RuntimeError, match="no int8 linear with handle -1"):
        int8_native.linear(x, -1, 48)


def test_the_weight_is_released_with_its_module(built):
    q, gen = _linear(5)
    handle = q.native
    x = torch.randn(1, 32, generator=gen)
    int8_native.linear(x, handle, 48)
    del q
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no int8 linear with handle {handle}"):
        int8_native.linear(x, handle, 48)


def test_attach_counts_the_int8_linears_of_a_model(built):
    model = nn.Sequential(_linear(6)[0], nn.ReLU(), nn.Sequential(_linear(7, inp=48)[0]))
    assert int8_native.attach(model, model_cache_dir()) == 2
    assert int8_native.attach(nn.Sequential(nn.Linear(2, 2)), model_cache_dir()) == 0


def test_a_failed_build_is_logged_and_reported(monkeypatch, caplog, tmp_path):
    import torch.utils.cpp_extension as cpp

    def fail(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", fail)
    with caplog.at_level(logging.WARNING, logger="edserve.models.int8_native"):
        assert int8_native._build(tmp_path) is False
    assert "Ninja is required" in caplog.text and "opaque op" in caplog.text


def test_build_folder_names_the_torch_version(tmp_path):
    assert int8_native.build_dir(tmp_path).name.endswith(f"torch{torch.__version__}")


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(monkeypatch, tmp_path):
    """torch's builder waits for its lock file: one left by a killed build would block every
    later process; a lock older than STALE_LOCK_S goes, a live builder's stays."""
    import os
    import time

    import torch.utils.cpp_extension as cpp

    seen = []
    monkeypatch.setattr(cpp, "load", lambda *a, **k: seen.append(lock.exists()))
    monkeypatch.setattr(torch.library, "register_fake", lambda *a, **k: None)
    lock = int8_native.build_dir(tmp_path) / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - int8_native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert int8_native._build(tmp_path) is True
    lock.touch()  # a build under way now
    assert int8_native._build(tmp_path) is True
    assert seen == [False, True]
