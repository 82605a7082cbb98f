"""A small soak (``benchmarks/soak.py``) against a live ``edserve serve``: 24 requests at
concurrency 8 with 20 % bad inputs and 15 % clients that leave at random points (seed 134:
every bad-input kind and every way of leaving at least once); every good answer equals the
sequential reference, every bad input gets its 4xx, and afterwards the KV integrity check is
ok with 0 slots used (endpoint and gauge)."""

from __future__ import annotations

import sys
from pathlib import Path

from whisper_fixtures import DATA

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


def test_small_soak(tmp_path):
    s = soak.main(["--requests", "24", "--concurrency", "8", "--seed", "134",
                   "--bad", "0.2", "--disconnect", "0.15",
                   "--clips", str(DATA / "cards_005.wav"), str(DATA / "librivox_0870.wav"),
                   "--max-upload-mb", "1", "--rss-tolerance", "0.5",
                   "--server-flags", "--threads 1 --max-running-requests 8",
                   "--json", str(tmp_path / "soak.json")])
    c = s["counts"]
    assert s["failures"] == [], (s["failures"], s["problems"])
    assert c.get("lost", 0) == 0 and c.get("wrong", 0) == 0 and c.get("bad_unexpected", 0) == 0
    assert c["good_ok"] == 13 and c["bad_refused"] == 6  # the seed's 13 good, 6 bad inputs
    assert {k for k in c if k.startswith("left_")} == {
        "left_upload", "left_processing", "left_stream"}
    assert s["integrity"]["ok"] and s["integrity"]["kv_slots_used"] == 0
    assert s["kv_slots_used_metric"] == 0
    assert s["rss_ratio"] < 1.5
