"""SIGTERM on a real ``edserve serve --data-parallel-size 2`` process: in-flight requests are
drained, the server exits, and no worker process is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dp.reference import DATA, metric, single_engine_texts, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead (its parent reaps it)
        return f.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_drains_in_flight_requests_and_leaves_no_workers():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edserve", "serve", "--port", str(port),
                             "--data-parallel-size", "2", "--drain-timeout", "60"])
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            def healthy():
                try:
                    r = http.get("/health")
                except httpx.TransportError:
                    return None
                return r.json() if r.status_code == 200 else None

            health = wait_for(healthy, 180, "the server", step=0.5)
            pids = [w["pid"] for w in health["workers"]]
            assert len(pids) == 2 and all(_alive(p) for p in pids)
            audio = (DATA / "cards_005.wav").read_bytes()

            def post(_):
                return http.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                                 files={"file": ("a.wav", audio, "audio/wav")})

            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(post, i) for i in range(6)]
                wait_for(lambda: sum(metric(http.get("/metrics").text,
                                            "edserve_worker_inflight_requests", w)
                                     for w in (0, 1)) >= 2, 60, "requests in flight")
                proc.send_signal(signal.SIGTERM)
                responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 6
        assert {r.json()["text"] for r in responses} == {single_engine_texts()["cards_005"]}
        assert proc.wait(90) == 0
        wait_for(lambda: not any(_alive(p) for p in pids), 30, "the workers to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("the server did not exit on SIGTERM")
