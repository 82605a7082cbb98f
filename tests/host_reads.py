"""Host reads of device values on CPU: a structural check that a code path never waits for
the device (on CUDA the same calls would sync); see ``tests/engine/test_prefill_syncs.py``."""

from __future__ import annotations

from contextlib import contextmanager

import torch

# Tensor methods that copy a value to the host (a device->host sync on CUDA).
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
               "numpy", "nonzero")


class HostRead(AssertionError):
    pass


@contextmanager
def host_reads_raise(monkeypatch, backend):
    """Inside: the methods of ``_HOST_READS`` raise, except inside ``backend.attend``."""
    state = {"allowed": 0}

    def guard(name, original):
        def wrapper(self, *args, **kwargs):
            if not state["allowed"]:
                raise HostRead(f"Tensor.{name} in a step that must not read the device")
            return original(self, *args, **kwargs)
        return wrapper

    attend = backend.attend

    def allowed_attend(*args, **kwargs):
        state["allowed"] += 1
        try:
            return attend(*args, **kwargs)
        finally:
            state["allowed"] -= 1

    with monkeypatch.context() as m:
        m.setattr(backend, "attend", allowed_attend)
        for name in _HOST_READS:
            m.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
        m.setattr(torch, "nonzero", guard("nonzero", torch.nonzero))
        yield
