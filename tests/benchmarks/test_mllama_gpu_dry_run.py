"""``benchmarks/mllama_gpu.py --dry-run``: the H200 benchmark's whole path (HF model, shared
weights, three strategies, HF runs, measurements, JSON) on the toy config on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_dry_run_writes_summary(tmp_path):
    import mllama_gpu

    out = tmp_path / "summary.json"
    assert mllama_gpu.main(["--dry-run", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["strategy"], r["page_size"]) for r in rows] == [("flat", 1), ("aligned", 16),
                                                               ("ragged", 1)]
    for r in rows:
        assert (r["image_requests"], r["text_requests"], r["tiles"]) == (2, 1, 5)
        assert r["tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["floor_ms"] > 0 and r["ttft_s"] > 0 and r["vision_ms_per_tile"] > 0
        # CPU fp32, image-first prompts: the engine's greedy tokens are HF's
        assert r["image_rows_identical"] == r["image_rows"] == 2
