"""Helpers shared by the server tests (audio uploads, the idle + integrity check, a live chat
server in this process and an ``openai`` client of it)."""

from __future__ import annotations

import contextlib
import io
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

DATA = Path(__file__).parent.parent / "data"
CLIPS = ["jfk", "librivox_0870", "cards_005"]
API_KEY = "test-key"
MAX_UPLOAD_MB = 4.0
MAX_AUDIO_SECONDS = 90.0


def wav_bytes(audio: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit mono WAV of float samples in [-1, 1]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def integrity(http: httpx.Client) -> dict:
    """Wait (bounded) until the engine is idle, then run the KV integrity check."""
    for _ in range(600):
        r = http.get("/debug/integrity")
        if r.status_code == 429:  # rate-limited: wait as told
            time.sleep(float(r.headers.get("retry-after", "1")))
            continue
        report = r.json()
        assert report.get("ok"), report
        if report["inflight"] == 0 and report["running"] == 0 and report["waiting"] == 0:
            assert report["kv_slots_used"] == 0, report
            return report
        time.sleep(0.1)
    raise AssertionError(f"engine never became idle: {report}")


def wait_healthy(proc, url: str, log_path: Path, timeout: float = 120.0) -> None:
    """Wait until the ``edserve serve`` subprocess ``proc`` answers ``GET /health`` with 200;
    fail with its log if it exits first, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, *flags: str, **popen: Any) -> tuple[Any, str]:
    """``python -m edserve serve`` on a free loopback port with ``flags``, waited for with
    :func:`wait_healthy`; returns (Popen, base URL). The caller terminates it."""
    import subprocess
    import sys

    port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "edserve", "serve", "--port", str(port),
                             *flags], stdout=log, stderr=subprocess.STDOUT, **popen)
    log.close()  # the child holds its own descriptor
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return proc, url


@contextlib.contextmanager
def chat_server(folder: Path, model: str, engine: dict, engine_process: bool = False
                ) -> Iterator[tuple[Any, Any, Any]]:
    """A live server on the chat model in ``folder`` (debug endpoints on, the engine in this
    process or in a worker process): yields ``(server thread, engine client, app)``, and shuts
    both down after."""
    from edserve.config import EngineConfig
    from edserve.server.config import ServerConfig
    from edserve.server.launch import ServerThread, build

    cfg = ServerConfig(served_model_name=model, enable_debug_endpoints=True,
                       debug_rate_limit=100.0, engine_process=engine_process)
    client, app = build(EngineConfig(model=str(folder), **engine), cfg)
    srv = ServerThread(app, "127.0.0.1", 0).start()
    try:
        yield srv, client, app
    finally:
        srv.stop()
        client.shutdown(5.0)


@contextlib.contextmanager
def openai_client(url: str, timeout: float = 300) -> Iterator[Any]:
    """The official ``openai`` client of the server at ``url`` (no retries)."""
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                       timeout=timeout) as c:
        yield c
