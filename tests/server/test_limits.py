"""Connection and resource limits of a real ``edserve serve`` process (open-file limit lowered
to 256, short timeouts): silent, slow-header and slow-body connections are closed; 300 idle
sockets do not lock out ``/health``; hours of (tiny) FLAC are refused with bounded memory."""

from __future__ import annotations

import io
import resource
import socket
import subprocess
import sys
import time

import av
import httpx
import numpy as np
import pytest

from .server_helpers import wait_healthy

NOFILE = 256
TIMEOUT = 1.0  # header, body and keep-alive timeouts of the test server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request, tmp_path_factory):
    """(url, Popen, log path) of ``edserve serve`` under ``ulimit -n 256``, with each HTTP
    parser (``--http``: the guard is mixed into both)."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("limits") / "serve.log"
    log = log_path.open("w")
    cmd = [sys.executable, "-m", "edserve", "serve", "--port", str(port),
           "--max-running-requests", "2", "--max-audio-seconds", "60",
           "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT),
           "--timeout-keep-alive", str(TIMEOUT), "--http", request.param]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_files)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
        yield url, proc, log_path
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """Read until the server closes; fail if it takes longer than ``seconds``."""
    start, data = time.monotonic(), b""
    sock.settimeout(seconds)
    while chunk := sock.recv(4096):
        data += chunk
    assert time.monotonic() - start < seconds
    return data


def test_silent_and_slow_header_connections_are_closed(server):
    url = server[0]
    with _connect(url) as silent:
        assert _closed_within(silent, TIMEOUT + 3) == b""
    with _connect(url) as slow:
        start = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        try:
            while time.monotonic() - start < TIMEOUT + 3:
                slow.sendall(b"X")  # one header byte at a time, never finishing the head
                time.sleep(0.2)
        except OSError:
            pass  # closed by the server
        assert _closed_within(slow, TIMEOUT + 3) == b""


def test_slow_body_gets_408(server):
    with _connect(server[0]) as s:
        s.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: multipart/form-data; boundary=x\r\n"
                  b"Content-Length: 100000\r\n\r\n--x\r\n")
        reply = _closed_within(s, TIMEOUT + 5)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


def test_idle_socket_flood_does_not_lock_out_health(server):
    url, proc, log_path = server
    socks = []
    try:
        for _ in range(300):  # more than the server's open-file limit
            try:
                socks.append(_connect(url))
            except OSError:
                break
        assert len(socks) >= 250
        start = time.monotonic()
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 200 and time.monotonic() - start < 5
    finally:
        for s in socks:
            s.close()
    assert proc.poll() is None
    assert log_path.read_text().count("out of system resource") <= 2


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _silent_flac(hours: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        stream.format = "s16"
        minute = np.zeros((1, rate * 60), dtype=np.int16)
        for _ in range(int(hours * 60)):
            frame = av.AudioFrame.from_ndarray(minute, format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def test_hours_of_flac_refused_quickly_with_bounded_memory(server):
    url, proc, _ = server
    flac = _silent_flac(3.0)
    assert len(flac) < 4 * 2**20
    before = _rss_kib(proc.pid)
    start = time.monotonic()
    r = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("long.flac", flac)},
                   data={"model": "whisper-1"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_long", r.text
    assert "60 s limit" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10
    grown = (_rss_kib(proc.pid) - before) / 1024
    assert grown < 100, f"server RSS grew {grown:.0f} MiB"  # 3 h decoded: > 600 MiB
