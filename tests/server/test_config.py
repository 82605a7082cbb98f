"""Server defaults and the ``edserve serve`` command line (no server started)."""

from __future__ import annotations

from edserve.cli import build_parser
from edserve.config import EngineConfig, config_from_args
from edserve.server.config import ServerConfig


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
