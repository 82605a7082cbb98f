"""``benchmarks/gpu_idle.py``: the stack sampler attributes a thread's time to its deepest
``edserve`` frame, and the script's dry run (toy model on CPU, where the device is never busy)
prints a frame table whose idle time covers the call."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_sampler_names_the_deepest_edserve_frame():
    import gpu_idle

    from edserve.audio.mel import host_contiguous  # any edserve function, called below

    done = threading.Event()

    def busy() -> None:  # edserve's frame stays on the stack while this loops in it
        import torch
        x = torch.zeros(4, 6).t()
        while not done.is_set():
            host_contiguous(x)

    worker = threading.Thread(target=busy)
    worker.start()
    sampler = gpu_idle.StackSampler(worker.ident, 0.001)
    sampler.start()
    time.sleep(0.2)
    sampler.stop.set()
    sampler.join()
    done.set()
    worker.join()
    labels = [label for _, label in sampler.samples]
    assert len(labels) > 20
    inside = [label for label in labels if not label.startswith("(outside")]
    assert len(inside) > len(labels) // 4  # the loop's own lines are outside edserve
    assert all(label.startswith("audio/mel.py:") and label.endswith(" host_contiguous")
               for label in inside)


def test_dry_run_prints_idle_by_frame(capsys, monkeypatch):
    import gpu_idle

    monkeypatch.setattr(sys, "argv", ["gpu_idle.py", "--dry-run", "--scenarios", "prefill16",
                                      "--rows", "5"])
    gpu_idle.main()
    out = capsys.readouterr().out
    head = re.search(r"## prefill16: wall ([\d.]+) ms .*device busy 0.0 ms", out)
    assert head, out
    rows = re.findall(r"\| `([^`]+)` \| ([\d.]+) \|", out)
    assert any(frame.startswith("models/") for frame, _ in rows)  # the encoder shows up
    assert sum(float(ms) for _, ms in rows[:5]) <= float(head.group(1)) + 1.0


def test_dry_run_cprofile_lists_engine_functions(capsys, monkeypatch):
    import gpu_idle

    monkeypatch.setattr(sys, "argv", ["gpu_idle.py", "--dry-run", "--scenarios", "decode1",
                                      "--cprofile", "8"])
    gpu_idle.main()
    out = capsys.readouterr().out
    assert re.search(r"## decode1: cProfile, wall [\d.]+ ms", out), out
    assert "Ordered by: internal time" in out and "Ordered by: cumulative time" in out
    assert "engine.py" in out  # Engine.step's frames are in the cumulative list
