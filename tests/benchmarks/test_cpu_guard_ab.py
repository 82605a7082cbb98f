"""``benchmarks/cpu_guard_ab.py`` runs (one round, the embedded tiny.en compiled by inductor) and
finds the same text with and without dynamo's full guard check."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_guard_ab_one_round(capsys):
    import cpu_guard_ab

    assert cpu_guard_ab.main(["--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "text equal: True" in out and "full: median" in out and "skip: median" in out
