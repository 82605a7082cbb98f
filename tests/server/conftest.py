"""One live ``edserve serve`` (tiny.en, uvicorn in a thread on 127.0.0.1:<ephemeral>) shared by
the server tests, plus helpers to build audio uploads."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

from .server_helpers import API_KEY, CLIPS, DATA, MAX_AUDIO_SECONDS, MAX_UPLOAD_MB, wav_bytes


@pytest.fixture(scope="session")
def live_server():
    """(ServerThread, AsyncEngine); debug endpoints on, small upload/duration limits."""
    cfg = ServerConfig(api_key=API_KEY, max_upload_mb=MAX_UPLOAD_MB,
                       max_audio_seconds=MAX_AUDIO_SECONDS, enable_debug_endpoints=True,
                       debug_rate_limit=100.0)
    aengine, app = build(EngineConfig(max_running_requests=16), cfg)
    server = ServerThread(app, "127.0.0.1", 0).start()
    yield server, aengine
    server.stop()
    aengine.shutdown()


@pytest.fixture(scope="session")
def base_url(live_server) -> str:
    return live_server[0].url


@pytest.fixture(scope="session")
def client(base_url):
    import openai

    with openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="session")
def long_clip(tmp_path_factory) -> tuple[Path, float]:
    """A > 30 s WAV: the three clips twice over, with 1 s pauses; returns (path, seconds)."""
    pause = np.zeros(16000, dtype=np.float32)
    parts = []
    for _ in range(2):
        for c in CLIPS:
            parts += [load_audio(DATA / f"{c}.wav"), pause]
    audio = np.concatenate(parts)
    path = tmp_path_factory.mktemp("long") / "long.wav"
    path.write_bytes(wav_bytes(audio))
    return path, len(audio) / 16000
