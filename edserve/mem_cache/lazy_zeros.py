"""Zero-filled buffers whose pages the OS fills on first touch (host memory).

``torch.zeros`` on the CPU writes every byte: the embedded model's KV pool (384 MB of float32)
took ~0.12 s of a ~3.3 s ``edserve transcribe`` of one short clip, for pages most runs never
touch. :func:`lazy_zeros` takes the memory from ``calloc`` instead (through NumPy): large blocks
come straight from ``mmap``, already zero, and a page costs something only when a kernel first
writes it. On other devices it is ``torch.zeros``.

Contract: the result reads as zeros, is writable, owns its memory (freed with the tensor), is
contiguous, and its data pointer is :data:`ALIGN`-byte aligned (vectorised kernels).
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: Byte alignment of a host buffer's first element (an AVX-512 register / a cache line).
ALIGN = 64


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """A zero tensor of ``shape`` and ``dtype``; on the CPU backed by ``calloc`` memory."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    raw = torch.from_numpy(np.zeros(nbytes + ALIGN, dtype=np.uint8))  # calloc'd
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)
