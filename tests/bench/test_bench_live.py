"""``edserve bench`` against a live ``edserve serve`` subprocess (embedded tiny.en, CPU):
concurrency and Poisson-rate modes, json and SSE streams, failures counted by status, the
``--json`` document, and the server's stage histograms (``edserve_request_stage_seconds``)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from whisper_fixtures import DATA

from edserve.cli import build_parser
from tests.server.server_helpers import integrity, start_server

API_KEY = "bench-key"
STAGES = ("upload_read", "audio_wait", "audio_decode", "features", "queue_wait", "prefill",
          "decode", "response")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("bench") / "serve.log",
                             "--api-key", API_KEY, "--max-running-requests", "4",
                             "--enable-debug-endpoints", "--debug-rate-limit", "100")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _bench(url: str, *argv: str) -> int:
    args = build_parser().parse_args(["bench", "--base-url", url, "--api-key", API_KEY,
                                      "--no-progress", *argv])
    return args.func(args)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f"{s.name}{s.labels.get('stage', '')}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_concurrency_mode_json_failures_and_stages(server, tmp_path, capsys):
    bad = tmp_path / "corrupt.wav"
    bad.write_bytes(b"RIFF" + bytes(range(256)) * 8)
    out = tmp_path / "result.json"
    before = _metrics(server)
    assert _bench(server, str(DATA / "cards_005.wav"), str(bad), "--num-requests", "4",
                  "--concurrency", "2", "--json", str(out)) == 0
    printed = capsys.readouterr().out
    assert "Request throughput (req/s):" in printed and "status 400:" in printed
    s = json.loads(out.read_text())
    assert s["num_requests"] == 4 and s["completed"] == 2 and s["failed"] == 2
    assert s["failures"] == {"400": 2}
    assert s["config"]["concurrency"] == 2 and s["config"]["request_rate"] is None
    assert s["requests_per_s"] == pytest.approx(2 / s["duration_s"])
    assert s["audio_seconds"] == pytest.approx(2 * 3.5025, abs=0.01)
    lat = s["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] and s["ttft_ms"] is None
    # the stage breakdown: every stage, counted once per successful request (the corrupt
    # uploads were read, then refused by the decoder)
    stages = s["stages"]
    assert set(stages) == set(STAGES)
    assert stages["upload_read"]["count"] == 4
    for name in STAGES[1:]:
        assert stages[name]["count"] == 2, name
        assert stages[name]["total_s"] > 0, name
    # ordered sensibly: the engine stages and the request's other stages fit in the server's
    # own latency (parsed upload -> response), which fits in the client's latency
    after = _metrics(server)
    server_s = after["edserve_request_latency_seconds_sum"] - \
        before.get("edserve_request_latency_seconds_sum", 0.0)
    inside = sum(stages[n]["total_s"] for n in STAGES[1:])
    assert 0 < inside <= server_s + 1e-3
    assert server_s <= 2 * lat["p99"] / 1000
    assert after["edserve_request_stage_seconds_countprefill"] >= 2
    # the engine's step totals: each good request (one window) was admitted by one prefill or
    # mixed step, and the steps' wall time fits in the run
    steps = s["engine_steps"]
    assert set(steps) == {"decode", "prefill", "mixed", "idle"}
    admitted = sum(d["steps"] * d["new_rows_per_step"] for d in steps.values())
    assert admitted == pytest.approx(2)
    assert steps["decode"]["steps"] > 0 and steps["decode"]["new_rows_per_step"] == 0
    assert 0 < sum(steps[k]["share"] for k in ("decode", "prefill", "mixed")) <= 1.0
    assert steps["idle"]["share"] > 0 and steps["idle"]["steps"] == 0
    assert "Engine steps (per kind)" in printed


def test_rate_mode_stream_records_ttft(server, tmp_path):
    out = tmp_path / "stream.json"
    assert _bench(server, str(DATA / "cards_005.wav"), "--num-requests", "3",
                  "--request-rate", "20", "--seed", "3", "--stream", "--field", "language=en",
                  "--json", str(out)) == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 3 and s["failures"] == {}
    assert s["config"]["request_rate"] == 20 and s["config"]["concurrency"] == 3
    assert s["config"]["fields"] == {"language": "en"} and s["config"]["stream"] is True
    assert 0 < s["ttft_ms"]["p50"] <= s["latency_ms"]["p99"]
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        integrity(http)


def test_json_to_stdout_and_unauthorized_counted(server, capsys):
    args = build_parser().parse_args(["bench", str(DATA / "cards_005.wav"), "--base-url",
                                      server, "--num-requests", "2", "--no-progress",
                                      "--json", "-"])
    assert args.func(args) == 1  # nothing succeeded
    s = json.loads(capsys.readouterr().out)
    assert s["failures"] == {"401": 2} and s["latency_ms"] is None


def test_language_guesses_scraped(server):
    """``scrape_guesses`` reads edserve's guess counters (tiny.en is English-only: no window
    detects, so both are 0, exported from the start); a server without /metrics gives None."""
    from edserve.bench.report import scrape_guesses

    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert scrape_guesses(server, headers) == {"right": 0.0, "wrong": 0.0}
    assert scrape_guesses("http://127.0.0.1:9", headers) is None
