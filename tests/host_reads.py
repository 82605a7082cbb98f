"""Host reads of device values on CPU: a structural check that a code path never waits for
the device (on CUDA the same calls would sync); see ``tests/engine/test_prefill_syncs.py``.

``host_reads_raise`` makes every read raise; ``host_reads_counted`` counts them by the engine
line that asked (``file:line``), for paths allowed a known number of reads."""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a value to the host (a device->host sync on CUDA).
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
               "numpy", "nonzero")
_INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
              torch.ops.aten.index_put_.default)


class HostRead(AssertionError):
    pass


class _BoolIndex(TorchDispatchMode):
    """Indexing with a boolean mask (``t[mask]``: its size is read on the host)."""

    def __init__(self, on_read) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _INDEX_OPS and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.on_read("bool index")
        return func(*args, **(kwargs or {}))


@contextmanager
def _reads_call(monkeypatch, backend, on_read):
    """Inside: ``on_read(name)`` runs at every host read, except inside ``backend.attend``
    (the CPU attention reads lengths; the CUDA kernels do not)."""
    state = {"allowed": 0}

    def read(name):
        if not state["allowed"]:
            on_read(name)

    def guard(name, original):
        def wrapper(self, *args, **kwargs):
            read(name)
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
        with _BoolIndex(read):
            yield


@contextmanager
def host_reads_raise(monkeypatch, backend):
    """Inside: a host read raises :class:`HostRead`, except inside ``backend.attend``."""
    def fail(name):
        raise HostRead(f"Tensor.{name} in a step that must not read the device")

    with _reads_call(monkeypatch, backend, fail):
        yield


@contextmanager
def host_reads_counted(monkeypatch, backend):
    """Inside: host reads (outside ``backend.attend``) are counted in the yielded Counter,
    keyed by the innermost ``edserve`` line that made them."""
    sites: Counter = Counter()

    def count(name):
        frames = [f for f in traceback.extract_stack()[:-1] if "/edserve/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        sites[f"{name}@{where}"] += 1

    with _reads_call(monkeypatch, backend, count):
        yield sites
