"""``benchmarks/gpu_busy.py``: nvidia-smi's lines parsed (numbers kept, ``[N/A]`` and cut
lines skipped), samples taken on a thread while the block runs and averaged as a share; no
GPU reading (this CPU machine) gives None, not 0."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_busy  # noqa: E402
from gpu_busy import GpuBusy, parse_samples  # noqa: E402


def test_samples_parsed():
    assert parse_samples("87\n[N/A]\n93\n\n10") == [87.0, 93.0, 10.0]


def test_samples_taken_while_the_block_runs(monkeypatch):
    values = iter([80.0, None, 100.0] + [90.0] * 1000)
    monkeypatch.setattr(gpu_busy, "reader", lambda device: lambda: next(values))
    with GpuBusy(period=0.01) as busy:
        time.sleep(0.2)
    n = len(busy.samples)
    assert n >= 3 and busy.samples[:2] == [80.0, 100.0]  # None: no sample
    time.sleep(0.05)
    assert len(busy.samples) == n  # stopped with the block
    assert busy.share == pytest.approx(sum(busy.samples) / (100 * n))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine")
def test_without_a_gpu_the_share_is_unknown():
    with GpuBusy() as busy:
        time.sleep(0.15)
    assert busy.samples == [] and busy.share is None
