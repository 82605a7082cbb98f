"""Host list -> device tensor without a host<->device sync.

On CUDA the values are staged in page-locked memory and copied with ``non_blocking=True``:
PyTorch's caching host allocator keeps the staging buffer alive until the copy has run, so the
host may go on at once. (A copy from pageable memory makes the host wait for the stream.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
