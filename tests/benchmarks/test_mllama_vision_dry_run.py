"""``benchmarks/mllama_vision.py --dry-run``: the vision-only H200 benchmark's whole path (HF
vision model, shared weights, both attention plans, timings, the plans' difference) on CPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_dry_run_times_both_plans_and_hf(capsys):
    import mllama_vision

    assert mllama_vision.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for label in ("1 tile:", "4 tiles:", "mixed 4,1,2,3:"):
        line = next(x for x in out.splitlines() if x.strip().startswith(label))
        assert re.search(r"grouped +[\d.]+ ms/img .*masked +[\d.]+ ms/img .*hf +[\d.]+ ms/img",
                         line)
    diff = re.search(r"grouped ([\d.e+-]+), unfused ([\d.e+-]+), tanh ([\d.e+-]+), "
                     r"triton ([\d.e+-]+), hf ([\d.e+-]+)", out)
    assert diff, out
    grouped, unfused, tanh, triton, hf = (float(d) for d in diff.groups())
    assert max(grouped, unfused, triton, hf) < 1e-5  # same weights, fp32
    assert 0 < tanh < 1e-3  # --encoder-gelu tanh: another function, close (gap <= 4.8e-4)
