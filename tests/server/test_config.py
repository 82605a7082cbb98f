"""Server defaults and the ``edserve serve`` command line (no server started)."""

from __future__ import annotations

from edserve.cli import build_parser
from edserve.config import EngineConfig
from edserve.config_args import config_from_args
from edserve.server.config import ServerConfig

from .server_helpers import wait_healthy


def test_defaults_are_safe():
    cfg = ServerConfig()
    assert cfg.host == "127.0.0.1" and cfg.api_key is None
    assert cfg.max_upload_bytes == 25 * 2**20
    assert not cfg.enable_debug_endpoints and not cfg.condition_on_previous_text


def test_serve_flags_build_both_configs():
    args = build_parser().parse_args(
        ["serve", "--port", "0", "--api-key", "k", "--max-upload-mb", "2",
         "--max-audio-seconds", "60", "--condition-on-previous-text", "--page-size", "16"])
    server = config_from_args(args, ServerConfig)
    engine = config_from_args(args, EngineConfig)
    assert (server.port, server.api_key, server.max_upload_mb, server.max_audio_seconds) == \
        (0, "k", 2.0, 60.0)
    assert server.condition_on_previous_text and server.host == "127.0.0.1"
    assert engine.page_size == "16"


def test_edserve_serve_subprocess(tmp_path):
    """The real command: starts, binds 127.0.0.1, transcribes, exits on SIGTERM."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "edserve", "serve", "--port", str(port),
                             "--api-key", "k", "--max-running-requests", "2"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        clip = Path(__file__).parent.parent / "data" / "cards_005.wav"
        text = client.audio.transcriptions.create(model="whisper-1", file=clip.open("rb"),
                                                  response_format="text")
        assert "spades" in text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_hardening_flags():
    cfg = ServerConfig()
    assert cfg.allowed_origins is None and cfg.origins == ()
    assert cfg.max_pending_audio_bytes == 256 * 2**20 and cfg.debug_rate_limit == 5.0
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", "https://a.example/, https://B.example",
         "--max-connections", "64", "--header-timeout", "2.5", "--body-timeout", "3",
         "--timeout-keep-alive", "4", "--max-pending-audio-mb", "8", "--debug-rate-limit", "1"])
    server = config_from_args(args, ServerConfig)
    assert server.origins == ("https://a.example", "https://b.example")
    assert (server.max_connections, server.header_timeout, server.body_timeout,
            server.timeout_keep_alive, server.max_pending_audio_mb, server.debug_rate_limit) \
        == (64, 2.5, 3.0, 4.0, 8.0, 1.0)


def test_log_rate_limit_filter():
    import logging

    from edserve.server.connections import RateLimitFilter, connection_cap

    f = RateLimitFilter(("socket.accept() out of system resource",), interval=60)

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), None)

    passed = [f.filter(rec("socket.accept() out of system resource\nsocket: x"))
              for _ in range(100)]
    assert passed.count(True) == 1 and f.filter(rec("something else"))
    assert 8 <= connection_cap(10**6) < 10**6
