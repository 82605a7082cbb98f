"""Ray Serve on a local CPU Ray: 2 replicas of tiny.en answer concurrent transcriptions
through the ``openai`` client with the single-engine texts; Ray is shut down afterwards."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import ray
from dp.reference import CLIPS, DATA, single_engine_texts, wait_for
from ray import serve

from edserve.config import EngineConfig
from edserve.integrations.ray_serve import APP_NAME, build_app, replica_resources
from edserve.server.config import ServerConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transcribe(oai, clip: str) -> str:
    with open(DATA / f"{clip}.wav", "rb") as f:
        return oai.audio.transcriptions.create(model="whisper-1", file=f).text


def test_two_cpu_replicas_answer_8_concurrent_transcriptions(monkeypatch):
    expected = single_engine_texts()
    port = _free_port()
    # Ray starts its workers (the replicas) at nice 15: behind the other pytest worker's test on
    # a 2-core CI box they got scraps of CPU (minutes, and 408s); run them at the same priority
    monkeypatch.setenv("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        assert replica_resources(EngineConfig()) == {"num_gpus": 0, "num_cpus": 1.0}
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # uploads decoded on the replicas' threads (no audio worker processes on a 2-core CI
        # box); a generous body timeout: on a loaded box the proxy can pass a body on slowly
        server = ServerConfig(audio_workers=0, body_timeout=300.0)
        serve.run(build_app(EngineConfig(max_running_requests=8), server, replicas=2),
                  name=APP_NAME, route_prefix="/")
        status = serve.status().applications[APP_NAME].deployments["edserve"]
        assert status.replica_states.get("RUNNING") == 2, status
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60, "the Serve proxy")
        clips = [CLIPS[i % len(CLIPS)] for i in range(8)]
        with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                           timeout=300) as oai, ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda c: _transcribe(oai, c), clips))
        assert texts == [expected[c] for c in clips]
    finally:
        serve.shutdown()
        ray.shutdown()
    assert not ray.is_initialized()
