"""Regressions for the "Server hardening" probe (in-process server): uploads that point FFmpeg
at other files, NaN audio, errors inside streams and routes, debug endpoint guards, upload
limit texts, Origin/Host checks, the pending-audio budget, a client leaving mid-upload."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

import edserve.server.transcription as transcription
from edserve.audio.prepare import prepare_upload
from edserve.server.app import create_app
from edserve.server.config import ServerConfig
from edserve.server.guards import PendingBudget, RateLimiter
from edserve.server.launch import ServerThread

from .server_helpers import API_KEY, DATA, MAX_UPLOAD_MB, integrity

GOOD = (DATA / "jfk.wav").read_bytes()
JFK_PATH = str((DATA / "jfk.wav").resolve())
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code is not None:
        assert err["code"] == code, err
    return err


def _post(http, content: bytes, name: str = "a.wav", **fields) -> httpx.Response:
    return http.post("/v1/audio/transcriptions", files={"file": (name, content)},
                     data={"model": "whisper-1", **fields})


PLAYLISTS = {
    "ffconcat": f"ffconcat version 1.0\nfile {JFK_PATH}\n",
    "hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:11\n#EXTINF:11,\nfile://{JFK_PATH}\n"
           f"#EXTINF:11,\n{JFK_PATH}\n#EXT-X-ENDLIST\n",
}


@pytest.mark.parametrize("kind", sorted(PLAYLISTS))
def test_playlists_and_scripts_cannot_read_local_files(http, kind):
    for name in (f"x.{'ffconcat' if kind == 'ffconcat' else 'm3u8'}", "x.wav"):
        err = _error(_post(http, PLAYLISTS[kind].encode(), name), 400, "invalid_audio")
        assert err["message"] == transcription.UNDECODABLE
        assert "/" not in err["message"] and "jfk" not in err["message"]


def _float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" \
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) \
        + data


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("stream", ["false", "true"])
def test_non_finite_samples_are_400_even_when_streaming(http, bad, stream):
    audio = np.zeros(16000, dtype=np.float32)
    audio[100:200] = bad
    r = _post(http, _float_wav(audio), stream=stream)
    assert "text/event-stream" not in r.headers.get("content-type", "")
    assert "NaN or infinite" in _error(r, 400, "invalid_audio")["message"]


def test_error_inside_a_stream_is_an_sse_error_event(client, http, monkeypatch):
    async def failing(_client, _task, _on_output=None):
        yield SimpleNamespace(text=" hello")
        await asyncio.sleep(0)
        raise ValueError("boom at /secret/path")

    monkeypatch.setattr(transcription, "transcribe_async", failing)
    with http.stream("POST", "/v1/audio/transcriptions", files={"file": ("a.wav", GOOD)},
                     data={"model": "whisper-1", "stream": "true"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert json.loads(lines[0][6:])["type"] == "transcript.text.delta"
    assert lines[-2] == "event: error"
    event = json.loads(lines[-1][6:])
    assert event["type"] == "error" and event["error"]["type"] == "server_error"
    assert "/secret" not in event["error"]["message"]
    with pytest.raises(openai.APIError, match="transcription failed"):
        list(client.audio.transcriptions.create(model="whisper-1", file=("a.wav", GOOD),
                                                stream=True))


def _count(http, endpoint: str, status: str) -> float:
    text = http.get("/metrics").text
    key = f'edserve_http_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith(key)), 0.0)


def test_unhandled_exception_is_openai_500_and_counted(http, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("internal detail")

    monkeypatch.setattr(transcription, "render", broken)
    before = _count(http, "/v1/audio/transcriptions", "500")
    err = _error(_post(http, GOOD), 500, "server_error")
    assert "internal detail" not in err["message"]
    assert _count(http, "/v1/audio/transcriptions", "500") == before + 1


def test_debug_needs_key_and_is_rate_limited(base_url, live_server):
    assert httpx.get(base_url + "/debug/integrity").status_code == 401
    app = create_app(live_server[1], ServerConfig(api_key=API_KEY, debug_rate_limit=2.0,
                                                  enable_debug_endpoints=True))
    with TestClient(app, base_url="http://localhost", headers=AUTH) as tc:
        codes = [tc.get("/debug/integrity") for _ in range(6)]
    assert [r.status_code for r in codes].count(200) >= 2
    limited = [r for r in codes if r.status_code == 429]
    assert limited and int(limited[0].headers["retry-after"]) >= 1
    _error(limited[0], 429, "rate_limit_exceeded")
    limiter = RateLimiter(1000.0)
    for _ in range(1000):
        limiter.check()


def test_upload_limit_text_is_the_configured_value(http):
    mib = f"{MAX_UPLOAD_MB:g} MiB upload limit"
    for size in (MAX_UPLOAD_MB + 0.5, MAX_UPLOAD_MB + 3):  # parser limit, body limit
        big = GOOD + b"\0" * (int(size * 2**20) - len(GOOD))
        err = _error(_post(http, big), 413, "file_too_large")
        assert mib in err["message"] and f"{MAX_UPLOAD_MB + 1:g}" not in err["message"], err


def test_origin_and_host_checks(base_url, live_server):
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=30) as c:
        _error(c.get("/v1/models", headers={"Origin": "https://evil.example"}), 403,
               "origin_not_allowed")
        _error(c.get("/health", headers={"Host": "evil.example"}), 403, "host_not_allowed")
        _error(c.get("/health", headers={"Host": "rebind.attacker.test:8000"}), 403)
        for host in ("localhost", "127.0.0.1:9", "[::1]:8000", "LOCALHOST:1"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host
    cfg = ServerConfig(allowed_origins="https://app.example, https://b.example/")
    with TestClient(create_app(live_server[1], cfg), base_url="http://localhost") as tc:
        ok = tc.get("/v1/models", headers={"Origin": "https://app.example"})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        pre = tc.options("/v1/audio/transcriptions", headers={
            "Origin": "https://b.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
        _error(tc.get("/v1/models", headers={"Origin": "https://c.example"}), 403)
    public = ServerConfig(host="0.0.0.0")
    with TestClient(create_app(live_server[1], public), base_url="http://my.host") as tc:
        assert tc.get("/health").status_code == 200  # no Host check off loopback


def test_pending_audio_budget_503_with_retry_after(live_server):
    async def unit():
        budget = PendingBudget(100, wait=0.0)
        await budget.reserve(10_000)  # alone: always admitted
        with pytest.raises(Exception, match="busy"):
            await budget.reserve(1)
        budget.release(10_000)

    asyncio.run(unit())
    gate, entered = threading.Event(), threading.Event()

    def slow_job(*args):
        entered.set()
        gate.wait(30)
        return prepare_upload(*args)

    app = create_app(live_server[1], ServerConfig(max_pending_audio_mb=0.1, audio_workers=0,
                                                  pending_wait_seconds=0.3))
    app.state.audio.job = slow_job
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            first = threading.Thread(target=lambda: _post(c, GOOD))
            first.start()
            assert entered.wait(30)
            started = time.monotonic()
            r = _post(c, GOOD)  # waits its 0.3 s for room, then is refused
            _error(r, 503, "server_busy")
            assert r.headers["retry-after"] == "2" and time.monotonic() - started >= 0.3
            gate.set()
            first.join(60)
            assert app.state.pending.held == 0
            assert _post(c, GOOD).status_code == 200
    finally:
        gate.set()
        srv.stop()


def test_upload_burst_over_the_budget_waits_instead_of_503(live_server):
    """Issue 18's long-form run: 3 of 16 concurrent 10-minute WAVs (293 MiB against the
    256 MiB budget) got 503 at once. Each upload alone fits; together they queue and all
    succeed."""
    gate = threading.Event()

    def held_job(*args):
        gate.wait(30)  # the first uploads stay in the budget until the later ones wait
        return prepare_upload(*args)

    budget_mb = 1.6 * len(GOOD) / 2**20  # room for one upload at a time
    app = create_app(live_server[1], ServerConfig(max_pending_audio_mb=budget_mb,
                                                  audio_workers=0))
    app.state.audio.job = held_job
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            results: list[httpx.Response] = []
            posts = [threading.Thread(target=lambda: results.append(_post(c, GOOD)))
                     for _ in range(3)]
            for t in posts:
                t.start()
            deadline = time.monotonic() + 30
            while len(app.state.pending._waiters) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(app.state.pending._waiters) == 2  # two wait behind the first
            gate.set()
            for t in posts:
                t.join(120)
            assert [r.status_code for r in results] == [200] * 3, [r.text for r in results]
            assert app.state.pending.held == 0
    finally:
        gate.set()
        srv.stop()


def test_client_leaving_mid_upload_logs_one_line(base_url, http, caplog):
    caplog.set_level(logging.INFO, logger="edserve.server")
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\n"
                  f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000000\r\n"
                  "Content-Type: multipart/form-data; boundary=xx\r\n\r\n--xx\r\n"
                  'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
                  .encode() + b"\0" * 20000)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            "client disconnected" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    server_records = [r for r in caplog.records if r.name.startswith("edserve")]
    assert [r.levelno for r in server_records] == [logging.INFO], server_records
    assert server_records[0].exc_info is None
    integrity(http)
