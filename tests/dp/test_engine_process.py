"""``--engine-process``: the single-engine server on the worker-process path (one engine
worker behind the API process) answers like the in-process server, word timestamps included
(asked of the engine by a request field); and both clients implement the whole interface."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from dp.reference import DATA, single_engine_texts
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.engine.errors import RequestFailed
from edserve.engine.local_client import InProcessClient
from edserve.engine.protocol import EngineClient
from edserve.engine.request import GenerateRequest
from edserve.os_names import ENGINE_THREAD
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build


def test_both_clients_implement_the_whole_interface():
    assert InProcessClient.__abstractmethods__ == frozenset()
    assert DataParallelClient.__abstractmethods__ == frozenset()
    for cls in (InProcessClient, DataParallelClient):
        assert "__init__" in vars(cls)  # its own, nothing inherited by accident
    with pytest.raises(TypeError):
        EngineClient()  # abstract


def _words(url: str, clip: str) -> dict:
    with httpx.Client(base_url=url, timeout=300) as http, open(DATA / f"{clip}.wav", "rb") as f:
        r = http.post("/v1/audio/transcriptions", files={"file": (f"{clip}.wav", f)},
                      data={"model": "whisper-1", "response_format": "verbose_json",
                            "timestamp_granularities[]": "word"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def in_process_words():
    """verbose_json with words from the in-process server (the reference)."""
    aengine, app = build(EngineConfig(), ServerConfig())
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        return {c: _words(server.url, c) for c in ("jfk", "cards_005")}
    finally:
        server.stop()
        aengine.shutdown(5.0)


def test_engine_process_serves_like_the_in_process_engine(in_process_words):
    cfg = ServerConfig(engine_process=True)
    client, app = build(EngineConfig(), cfg)
    assert isinstance(client, DataParallelClient) and len(client.workers) == 1
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           timeout=300) as oai, open(DATA / "jfk.wav", "rb") as f:
            text = oai.audio.transcriptions.create(model="whisper-1", file=f).text
        assert text == single_engine_texts()["jfk"]
        for clip, expected in in_process_words.items():
            got = _words(server.url, clip)
            assert got["words"], got
            assert got["words"] == expected["words"]  # same words, same times
            assert got["text"] == expected["text"]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            health = http.get("/health")
            assert health.status_code == 200
            body = health.json()
            assert body["status"] == "ok" and [w["worker"] for w in body["workers"]] == [0]
        # the worker's stepping thread carries the in-process engine thread's OS name
        comm = Path(f"/proc/{client.workers[0].pid}/comm")
        assert not comm.exists() or comm.read_text().strip() == ENGINE_THREAD
        with pytest.raises(TypeError, match="EncoderKV"):
            client.release_encoder(object())
        client.validate(GenerateRequest([50257], torch.zeros(80, 3000), keep_encoder=True))
        hooked = GenerateRequest([50257], torch.zeros(80, 3000), on_finished_kv=print)
        with pytest.raises(RequestFailed, match="on_finished_kv"):
            client.validate(hooked)
    finally:
        server.stop()
        client.shutdown(5.0)
    assert not client.is_alive
