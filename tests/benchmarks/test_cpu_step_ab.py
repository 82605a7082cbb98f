"""``benchmarks/cpu_step_ab.py`` runs (one round, the embedded tiny.en compiled by inductor) and
finds the same text with each change to the compiled CPU step on and off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("change", ["aot", "cross-view", "boxed", "sampling"])
def test_step_ab_one_round(capsys, change):
    import cpu_step_ab

    assert cpu_step_ab.main(["--change", change, "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "text equal: True" in out and "off: median" in out and "on: median" in out
    assert f"; {change};" in out
