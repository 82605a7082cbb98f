"""The host work at a run's two ends does not grow by much per request: a prefill step admits
all its beam groups in one pass, beam groups ending together are released in one pass (one
group at a time cost ~63 torch ops per group at admission and ~29 at the end), and single-row
requests ending in one step free their rows in one release (one at a time: ~12 ops each)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_admission_and_release_ops_per_group():
    import beam_ends_cpu

    few, many = (beam_ends_cpu.measure(n, 5, 4) for n in (2, 8))
    assert len(few) == len(many) == 5  # prefill + 3 decode steps + the step the groups end
    per_group_admit = (many[0][0] - few[0][0]) / 6
    per_group_end = (many[-1][0] - few[-1][0]) / 6
    assert per_group_admit < 20, per_group_admit  # per request: its log-mel upload etc.
    assert per_group_end < 5, per_group_end


def test_single_rows_ending_together_free_in_one_release():
    import beam_ends_cpu

    few, many = (beam_ends_cpu.measure(n, 1, 4) for n in (2, 8))
    assert (many[-1][0] - few[-1][0]) / 6 < 2  # the last step's ops per extra request
