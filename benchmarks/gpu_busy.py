"""The GPU's busy share while a benchmark level runs, read from the driver: NVML's
``utilization.gpu`` (the share of its last sample period, 1/6 s to 1 s, in which any kernel
was running) sampled every ``period`` seconds on a background thread, through
``torch.cuda.utilization`` when pynvml is installed, else one ``nvidia-smi`` query a sample.
For a server whose engine runs in another process the torch profiler cannot see, this tells a
device-bound level (~100 %) from one bound by its host or its feed.

    with GpuBusy() as busy:
        run_level()
    busy.share  # mean of the samples, 0..1; None without a GPU reading (CPU runs)
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable


class GpuBusy:
    def __init__(self, device: int = 0, period: float = 0.1) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuBusy:
        read = reader(self.device)
        if read is not None:
            self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self, read: Callable[[], float | None]) -> None:
        while not self._stop.wait(self.period):
            value = read()
            if value is not None:
                self.samples.append(value)

    @property
    def share(self) -> float | None:
        return sum(self.samples) / (100 * len(self.samples)) if self.samples else None


def reader(device: int) -> Callable[[], float | None] | None:
    """A function returning the GPU's utilization percent now, or None where there is none."""
    try:
        import torch

        torch.cuda.utilization(device)  # needs pynvml and a GPU
        return lambda: float(torch.cuda.utilization(device))
    except Exception:  # no CUDA, no pynvml: ask nvidia-smi
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i",
           str(device)]

    def query() -> float | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        values = parse_samples(out)
        return values[0] if values else None
    return query


def parse_samples(text: str) -> list[float]:
    """``utilization.gpu`` percentages, one per line; lines that are not a number (``[N/A]``,
    a cut line) are skipped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(float(line.strip()))
        except ValueError:
            continue
    return out
