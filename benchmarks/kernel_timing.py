"""Timing helpers shared by the kernel micro-benchmarks (``gpu_kernels.py``, ``add_norm_gpu.py``):
a median time per call and the device's copy bandwidth, the yardstick for memory-bound kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], dev: torch.device, rep: int = 50) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on CUDA (``rep`` ms of runs),
    one warm call then one timed call elsewhere (dry runs)."""
    if dev.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_gbs(dev: torch.device, bench: Callable[[Callable[[], object]], float],
             dry_run: bool) -> float:
    """Device-to-device copy rate of a 1 GiB buffer (1 MiB in a dry run), GB/s counting
    read + write."""
    nbytes = (1 << 20) if dry_run else (1 << 30)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    return 2 * nbytes / bench(lambda: bufs[1].copy_(bufs[0])) / 1e6


def device_label(dev: torch.device) -> str:
    """The GPU's name, or ``cpu (dry run)``."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
