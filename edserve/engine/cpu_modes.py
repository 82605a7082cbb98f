"""CPU threads, resolved and set once at engine start (``--threads``).

CPU modes (README "CPU", ``benchmarks/cpu_whisper.py``): ``--dtype auto`` is float32, the
fastest mode whose text equals float32's on every bundled clip; ``--quantization int8`` is the
fastest mode (text equal up to punctuation on the bundled English clips); bfloat16 runs on CPU
(``--dtype bfloat16``) but this project's AVX2 CPUs emulate its matmuls (~5x slower than fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once); falls back to the
    logical CPU count when the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus) or 1
    return len(cores) or 1


def resolve_threads(threads: int | None) -> int:
    """``--threads`` or, unset, ``$EDSERVE_THREADS`` or the physical core count."""
    if threads is not None:
        return threads
    env = os.environ.get("EDSERVE_THREADS", "")
    return int(env) if env.strip() else physical_cores()


def apply_threads(threads: int | None, device: torch.device) -> int | None:
    """Set torch's intra-op CPU threads once (CPU engines only); returns the count set."""
    if device.type != "cpu":
        return None
    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
