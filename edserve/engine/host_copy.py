"""Host list -> device tensor without a host<->device sync.

On CUDA the values are staged in page-locked memory and copied with ``non_blocking=True``:
PyTorch's caching host allocator keeps the staging buffer alive until the copy has run, so the
host may go on at once. (A copy from pageable memory makes the host wait for the stream.)

The list is packed by the standard library's :mod:`array` (C loop, ~12 ns per value on the dev
box) rather than ``torch.tensor(list)`` (~45 ns per value, an element-by-element type
inference): a beam step at 320 rows uploads ~10,000 values, and on the H200's host the five
``torch.tensor`` calls of such a step took 1.4 ms of its ~7 ms of host work. Values the array
module refuses (floats for an integer dtype, ``None``, ...) go through ``torch.tensor`` as
before, with its semantics and errors.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

# torch dtype -> array typecode of the same width and kind
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.int16: "h", torch.int8: "b",
              torch.uint8: "B", torch.float64: "d", torch.float32: "f"}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a 1-D CPU tensor of ``dtype`` (``torch.tensor(values, dtype=dtype)``'s
    result for a flat list of numbers; faster for long lists)."""
    code = _TYPECODES.get(dtype)
    if code is not None and len(values):
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):
            pass  # not plain numbers of that kind: torch decides (and raises) as before
    return torch.tensor(values, dtype=dtype)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = host_tensor(values, dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
