"""``benchmarks/chat_soak.py`` on the tiny chat model: every good answer (text, JSON, tool call,
choice, n=2; streamed or not) equals its sequential reference while bad inputs get their 400s
and clients leave mid-stream; the KV cache is empty and whole after."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_chat_soak_small(tmp_path):
    import chat_soak

    out = tmp_path / "soak.json"
    assert chat_soak.main(["--requests", "80", "--concurrency", "8", "--seed", "3",
                           "--rss-tolerance", "0.5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    counts = r["counts"]
    assert r["passed"] and not r["wrong"] and sum(counts.values()) == 80
    assert counts["good_equal"] >= 50 and counts.get("bad_400", 0) >= 3
    assert "good_wrong" not in counts and "bad_wrong" not in counts
    assert r["integrity"]["ok"] and r["integrity"]["kv_slots_used"] == 0


def test_check_reports_failures():
    import chat_soak

    good = {"wrong": [], "integrity": {"ok": True, "kv_slots_used": 0},
            "rss_after_warmup": 100, "rss_end": 105}
    assert chat_soak.check(good, 0.1) == []
    assert len(chat_soak.check({**good, "rss_end": 120}, 0.1)) == 1
    assert len(chat_soak.check({**good, "integrity": {"ok": True, "kv_slots_used": 3}},
                               0.1)) == 1
    assert chat_soak.check({**good, "wrong": ["x"]}, 0.1) == ["x"]
