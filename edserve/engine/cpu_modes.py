"""CPU threads, resolved and set once at engine start (``--threads``), and the CPU dtype.

CPU modes (README "CPU", ``benchmarks/cpu_whisper.py``): ``--dtype auto`` is bfloat16 on CPUs
with AMX tiles (measured 20 % faster than float32 with the same text on a 2-core Xeon with AMX)
and float32 elsewhere. On AVX-512 BF16 without AMX (a 2-core AMD EPYC) bf16 was measured
slower than float32 where it counts: ``edserve transcribe`` on the 10 bundled clips as whole
processes 11.1 / 11.7 / 12.7 s vs 8.8 / 9.9 / 9.4 s (interleaved; its batched decode steps
convert between dtypes and its logits GEMM leaves oneDNN), equal on one clip. On AVX2-only CPUs
bf16 matmuls are emulated (~5x slower than fp32). ``--quantization int8`` changes punctuation on
a bundled clip, so the fastest mode whose text equals float32's is float32 there.
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


# The CPU features under which bf16 is the faster CPU dtype (measured: AMX tiles; AVX-512 BF16
# alone is slower than float32 on the batched CLI, see the module doc).
BF16_FASTER_WITH = ("amx_tile",)
_PROBES = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
           "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported",
           "vnni": "_is_vnni_supported"}


def cpu_features() -> frozenset[str]:
    """This CPU's features as torch's CPU probes report them (``torch.cpu._is_*_supported``),
    plus ``torch.backends.cpu.get_cpu_capability()`` lower-cased (``avx2``, ``avx512``, ...)."""
    found = {torch.backends.cpu.get_cpu_capability().lower()}
    for name, probe in _PROBES.items():
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            found.add(name)
    return frozenset(found)


def auto_cpu_dtype(features: frozenset[str], quantization: str = "none") -> torch.dtype:
    """``--dtype auto`` on CPU: bfloat16 on CPUs with AMX tiles, float32 elsewhere (AVX-512
    BF16 alone measured slower; AVX2 bf16 is emulated) and under ``--quantization int8``
    (whose int8 x int8 linears take float32 activations)."""
    if quantization == "none" and any(f in features for f in BF16_FASTER_WITH):
        return torch.bfloat16
    return torch.float32
