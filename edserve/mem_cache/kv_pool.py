"""KVPool: the per-layer K and V buffers that KV slots index into.

Layout, for every layer::

    k_buffers[layer], v_buffers[layer]   [num_slots + page_size, num_kv_heads, head_dim]
        slots 0 .. page_size-1     : padding page (slot 0 is where graph-padded batches write)
        slots page_size .. end     : handed out by the allocator (page p = slots p*ps..p*ps+ps-1)

With page size 1 the padding is just slot 0 and slots 1..num_slots are usable. The pool does
not allocate slots itself; an allocator over ``num_slots`` hands them out.

Writes (:meth:`KVPool.set_kv`) go through a Triton row-copy kernel when the pool was built
with ``write_kernel`` and stores a 16/32-bit dtype (:mod:`edserve.kernels.kv_write`: one launch
for K and V, no per-element ``index_put``): an encoder's cross K/V (1500 rows per Whisper clip;
on the H200 ``index_put`` ran at ~0.8 TB/s) and every decode step's one row per request (two
``index_put`` launches per layer before, 0.23 ms of a large-v3 step at 64 rows). fp8 pools keep
``index_put`` after saturating the values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from edserve.mem_cache.errors import IndexOutOfRangeError
from edserve.mem_cache.lazy_zeros import lazy_zeros

logger = logging.getLogger("edserve")

_GB = 1024**3

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


class KVPool:
    """K and V buffers for every decoder layer, indexed by KV slot."""

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        check_indices: bool | None = None,
        write_kernel: bool = False,
    ):
        for name, value in (
            ("num_slots", num_slots),
            ("page_size", page_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"KVPool: {name} must be >= 1, got {value}")
        if num_slots % page_size:
            raise ValueError(f"KVPool: num_slots={num_slots} is not a multiple of {page_size=}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Bounds-checking loc costs a device->host sync; by default only on CPU.
        self.check_indices = self.device.type == "cpu" if check_indices is None else check_indices
        # Long writes through the Triton row-copy kernel (CUDA, or the CPU interpreter in tests);
        # not for float8 pools, whose saturating cast is done in torch.
        self.write_kernel = write_kernel and dtype != torch.float8_e4m3fn
        # copy_slots through the Triton pair-copy kernel (a bit copy: any dtype)
        self.copy_kernel = write_kernel

        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k_buffers: list[torch.Tensor] = [
            lazy_zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            lazy_zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]
        self.device = self.k_buffers[0].device  # normalised ("cuda" -> "cuda:0")
        # Called with (src, dst) by every copy_slots before it copies (tensor-parallel rank 0
        # hands the copy to the other ranks' pool shards).
        self.copy_observers: list[Callable[[torch.Tensor, torch.Tensor], None]] = []
        itemsize = torch.empty((), dtype=dtype).element_size()
        # K and V of one token across all layers.
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * itemsize
        self.k_bytes = sum(b.numel() * b.element_size() for b in self.k_buffers)
        self.v_bytes = sum(b.numel() * b.element_size() for b in self.v_buffers)
        logger.info(
            "KV cache allocated. dtype: %s, #tokens: %d, K size: %.2f GB, V size: %.2f GB",
            dtype,
            num_slots,
            self.k_bytes / _GB,
            self.v_bytes / _GB,
        )

    @property
    def num_buffer_slots(self) -> int:
        """Rows in each buffer: usable slots plus the padding page."""
        return self.num_slots + self.page_size

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers of ``layer``, each ``[num_slots + page_size, kv_heads, head_dim]``."""
        self._check_layer(layer)
        return self.k_buffers[layer], self.v_buffers[layer]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[i]``/``v[i]`` to slot ``loc[i]`` of ``layer``.

        loc: [N] integer; k, v: [N, num_kv_heads, head_dim] floating point, cast to the pool
        dtype (float8_e4m3fn: saturated at +-448, scale 1; readers cast back). Shape or dtype
        mistakes raise ``ValueError``; a slot outside the buffer raises
        ``IndexOutOfRangeError`` (checked when ``check_indices``; padding slots are valid).
        """
        self._check_layer(layer)
        if loc.dim() != 1 or loc.dtype.is_floating_point or loc.dtype == torch.bool:
            raise ValueError(
                f"set_kv: loc must be a 1-D integer tensor, got shape {tuple(loc.shape)} "
                f"dtype {loc.dtype}"
            )
        want = (loc.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"set_kv: {name} has shape {tuple(t.shape)}, expected {want} "
                    f"([len(loc), num_kv_heads, head_dim])"
                )
            if not t.dtype.is_floating_point:
                raise ValueError(f"set_kv: {name} must be floating point, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"set_kv: {name} is on {t.device}, the pool on {self.device}")
        if loc.device != self.device:
            raise ValueError(f"set_kv: loc is on {loc.device}, the pool on {self.device}")
        if self.check_indices and loc.numel():
            lo, hi = int(loc.min()), int(loc.max())
            if lo < 0 or hi >= self.num_buffer_slots:
                raise IndexOutOfRangeError(
                    f"set_kv: slots must be in 0..{self.num_buffer_slots - 1}, got min {lo} "
                    f"max {hi}"
                )
        if self.write_kernel:  # never for fp8 (__init__)
            from edserve.kernels.kv_write import write_kv_rows

            write_kv_rows(self.k_buffers[layer], self.v_buffers[layer], loc, k.to(self.dtype),
                          v.to(self.dtype))
            return
        if self.dtype == torch.float8_e4m3fn:  # saturate (a plain cast may give NaN on CUDA)
            k, v = k.clamp(-_FP8_MAX, _FP8_MAX), v.clamp(-_FP8_MAX, _FP8_MAX)
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``K[dst[i]] = K[src[i]]`` and ``V[dst[i]] = V[src[i]]`` in every layer.

        src, dst: [N] integer slots on the pool's device; ``dst`` must not overlap ``src``
        (copy-on-write copies into fresh pages); a pair ``src[i] == dst[i]`` is a no-op
        (fixed-shape callers pad with ``0 -> 0``: with ``copy_kernel`` it moves no bytes). A
        slot outside the buffer raises ``IndexOutOfRangeError`` when ``check_indices`` (one
        host sync); sync-free otherwise.
        """
        for name, t in (("src", src), ("dst", dst)):
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"copy_slots: {name} must be a 1-D integer tensor, got shape "
                                 f"{tuple(t.shape)} dtype {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"copy_slots: {name} is on {t.device}, the pool on {self.device}")
        if src.shape != dst.shape:
            raise ValueError(
                f"copy_slots: src {tuple(src.shape)} and dst {tuple(dst.shape)} differ"
            )
        if not src.numel():
            return
        if self.check_indices:
            both = torch.cat([src, dst])  # [2N]
            lo, hi = torch.stack([both.min(), both.max()]).tolist()
            if lo < 0 or hi >= self.num_buffer_slots:
                raise IndexOutOfRangeError(
                    f"copy_slots: slots must be in 0..{self.num_buffer_slots - 1}, got min {lo} "
                    f"max {hi}"
                )
        for observe in self.copy_observers:
            observe(src, dst)
        if self.copy_kernel:  # one launch per layer; padding pairs cost nothing
            from edserve.kernels.kv_copy import copy_kv_rows

            src, dst = src.long(), dst.long()
            for k, v in zip(self.k_buffers, self.v_buffers, strict=True):
                copy_kv_rows(k, v, src, dst)
            return
        for k, v in zip(self.k_buffers, self.v_buffers, strict=True):  # [slots, heads, dim]
            k[dst] = k[src]
            v[dst] = v[src]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexOutOfRangeError(f"layer {layer} out of range 0..{self.num_layers - 1}")

    def __repr__(self) -> str:
        return (
            f"KVPool(num_slots={self.num_slots}, page_size={self.page_size}, "
            f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
