"""Where each data-parallel worker runs, decided in the API process without touching CUDA.

CUDA (``--device auto`` with a GPU, ``cuda``): one worker per visible GPU, worker ``i``
started with ``CUDA_VISIBLE_DEVICES=<the i-th visible id>`` and ``--device cuda``; asking for
more workers than visible GPUs is an error. CPU: every worker gets
``max(1, threads // N)`` torch threads, ``threads`` being ``--threads`` or, unset,
``$EDSERVE_THREADS`` or the physical core count (the cores are split, not oversubscribed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edserve.config import EngineConfig


@dataclass(frozen=True)
class Placement:
    """One worker's engine settings and the environment variables it starts with."""

    config: EngineConfig
    env: dict[str, str]
    label: str  # "cuda:<physical id>" or "cpu/<threads> threads"


def visible_gpus() -> list[str]:
    """The CUDA device ids this process may use (``CUDA_VISIBLE_DEVICES`` order)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]  # NVML: no CUDA context
    except Exception:
        return []


def plan(config: EngineConfig, n: int, gpus: list[str] | None = None) -> list[Placement]:
    """Placements of ``n`` workers for ``config`` (``gpus``: override the visible GPUs)."""
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    gpus = visible_gpus() if gpus is None else gpus
    device = config.device
    on_cuda = device.startswith("cuda") or (device == "auto" and bool(gpus))
    if on_cuda:
        if device not in ("auto", "cuda"):
            raise ValueError(f"--device {device} pins one GPU; with --data-parallel-size use "
                             "--device cuda (or auto) and CUDA_VISIBLE_DEVICES to choose GPUs")
        if n > len(gpus):
            raise ValueError(f"--data-parallel-size {n} needs {n} GPUs but {len(gpus)} are "
                             "visible (CUDA_VISIBLE_DEVICES)")
        return [Placement(config.replace(device="cuda"), {"CUDA_VISIBLE_DEVICES": gpus[i]},
                          f"cuda:{gpus[i]}") for i in range(n)]
    from edserve.engine.cpu_modes import resolve_threads

    per = max(1, resolve_threads(config.threads) // n)
    cfg = config.replace(device="cpu", threads=per)
    return [Placement(cfg, {"CUDA_VISIBLE_DEVICES": ""}, f"cpu/{per} threads")
            for _ in range(n)]
