"""``edserve serve --data-parallel-size 2`` on CPU (tiny.en): real worker processes behind the
real app, driven through the ``openai`` client."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dp.reference import CLIPS, DATA, metric, single_engine_texts, wait_for
from edserve.config import EngineConfig
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

KEY = "dp-key"


@pytest.fixture(scope="module")
def dp_server():
    cfg = ServerConfig(api_key=KEY, enable_debug_endpoints=True, debug_rate_limit=1000.0,
                       data_parallel_size=2)
    client, app = build(EngineConfig(), cfg)
    server = ServerThread(app, "127.0.0.1", 0).start()
    yield server, client
    pids = [w.pid for w in client.workers]
    server.stop()
    client.shutdown(5.0)
    for pid in pids:  # no orphans: every worker process is gone (and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def http(dp_server):
    with httpx.Client(base_url=dp_server[0].url, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def oai(dp_server):
    with openai.OpenAI(base_url=dp_server[0].url + "/v1", api_key=KEY, max_retries=0,
                       timeout=300) as c:
        yield c


def transcribe(oai, clip: str):
    """The text, or the APIStatusError the server answered."""
    try:
        with open(DATA / f"{clip}.wav", "rb") as f:
            return oai.audio.transcriptions.create(model="whisper-1", file=f).text
    except openai.APIStatusError as exc:
        return exc


def idle_integrity(http: httpx.Client) -> dict:
    def idle():
        r = http.get("/debug/integrity").json()
        assert r["ok"], r
        return r if r["inflight"] == r["running"] == r["waiting"] == 0 else None

    report = wait_for(idle, 60, "idle workers")
    assert len(report["workers"]) == 2
    for w in report["workers"]:
        assert w["ok"] and w["kv_slots_used"] == 0 and w["inflight"] == 0, report
    return report


def test_20_concurrent_requests_match_one_engine_and_use_both_workers(dp_server, http, oai):
    expected = single_engine_texts()
    clips = [CLIPS[i % len(CLIPS)] for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        texts = list(pool.map(lambda c: transcribe(oai, c), clips))
    assert texts == [expected[c] for c in clips]
    body = http.get("/metrics").text
    routed = [metric(body, "edserve_worker_requests_total", w) for w in (0, 1)]
    assert sum(routed) == 20 and min(routed) >= 5, routed  # least-loaded: both busy
    assert all(metric(body, "edserve_worker_generated_tokens_total", w) > 0 for w in (0, 1))
    assert metric(body, "edserve_worker_up", 0) == metric(body, "edserve_worker_up", 1) == 1
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    idle_integrity(http)


def test_killed_worker_fails_its_requests_with_503_and_comes_back(dp_server, http, oai):
    server, client = dp_server
    expected = single_engine_texts()
    victim = client.workers[1]
    old_pid = victim.pid
    clips = ["jfk"] * 16
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(transcribe, oai, c) for c in clips]
        wait_for(lambda: len(victim.inflight) >= 2 and len(client.workers[0].inflight) >= 2,
                 120, "requests on both workers")
        os.kill(old_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    failed = [r for r in results if not isinstance(r, str)]
    assert failed, "the killed worker had requests in flight"
    for exc in failed:
        assert exc.status_code == 503
        assert exc.body["code"] == "worker_lost" and exc.body["type"] == "server_error"
    assert all(r == expected["jfk"] for r in results if isinstance(r, str))
    assert len(failed) < len(results)  # the other worker kept serving
    # The worker comes back (a new process) and serves again.
    wait_for(lambda: victim.ready and victim.pid != old_pid, 120, "the restarted worker")
    body = http.get("/metrics").text
    assert metric(body, "edserve_worker_restarts_total", 1) == 1
    assert metric(body, "edserve_worker_lost_requests_total", 1) == len(failed)
    before = victim.routed
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda c: transcribe(oai, c), ["cards_005"] * 8))
    assert again == [expected["cards_005"]] * 8
    assert victim.routed > before
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["workers"][1]["restarts"] == 1
    idle_integrity(http)


def test_word_timestamps_come_back_from_the_workers(http):
    """The KV lives in the workers: each window asks its worker for the alignment by a
    request field and gets it in the output (equality with the in-process server:
    test_engine_process.py)."""
    with open(DATA / "jfk.wav", "rb") as f:
        r = http.post("/v1/audio/transcriptions", files={"file": ("jfk.wav", f)},
                      data={"model": "whisper-1", "response_format": "verbose_json",
                            "timestamp_granularities[]": "word"})
    assert r.status_code == 200, r.text
    body = r.json()
    words = body["words"]
    assert words and " ".join(w["word"] for w in words).startswith("And so my fellow Americans")
    assert words[-1]["word"] == "country." and body["text"].endswith("country.")
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and all(0 <= w["start"] <= w["end"] <= 11.01 for w in words)
