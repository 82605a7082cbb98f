"""``benchmarks/chat_load.py``: a random-weight folder written by ``--save-random`` (toy size,
CPU) served in-process and driven by concurrent streamed image chats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_save_random_then_load(tmp_path):
    import chat_load

    folder = tmp_path / "toy"
    assert chat_load.main(["--save-random", str(folder), "--size", "toy"]) == 0
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    out = tmp_path / "load.json"
    assert chat_load.main(["--serve", str(folder), "--device", "cpu", "--image-px", "56",
                           "--clients", "3", "--requests", "6", "--max-tokens", "6",
                           "--max-running", "4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 6 and r["clients"] == 3
    assert 0 < r["completion_tokens"] <= 6 * 6
    assert 0 < r["ttft_p50"] <= r["ttft_p95"] and r["ttft_p50"] <= r["latency_p95"]


def test_json_mode_dry_run(tmp_path):
    pytest.importorskip("llguidance")
    import chat_load

    out = tmp_path / "json.json"
    assert chat_load.main(["--dry-run", "--response-format", "json_object",
                           "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 8 and 0 < r["completion_tokens"] <= 8 * 8
    assert r["ttft_p50"] < r["latency_p95"]  # the "{" arrives before the answer ends
