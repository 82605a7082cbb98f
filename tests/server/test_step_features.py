"""``--step-features``: a short upload travels to the engine as its samples and its log-mel
is computed in the prefill step; the texts equal the host path's (through an engine worker
process and the in-process engine, a 16 kHz WAV read in the API process and a 22.05 kHz one
decoded by an audio worker), long uploads still get the device's log-mel, the pools stay
intact, and the policy and settings refuse what they cannot do (CPU, tiny.en)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.server.config import ServerConfig
from edserve.server.feature_policy import FeaturePolicy
from edserve.server.launch import ServerThread, build

from .server_helpers import DATA, wav_bytes


@pytest.fixture(scope="module")
def uploads() -> dict[str, bytes]:
    jfk = load_audio(DATA / "jfk.wav")
    pause = np.zeros(8000, np.float32)
    long = np.concatenate([jfk, pause, jfk, pause, jfk])  # 34 s: two windows
    return {"jfk": (DATA / "jfk.wav").read_bytes(),
            "resampled": wav_bytes(load_audio(DATA / "librivox_0870.wav"), rate=22050),
            "long": wav_bytes(long)}


def _serve(cfg: ServerConfig, uploads: dict[str, bytes]) -> tuple[dict[str, str], list, dict]:
    """(texts, samples of each ``features`` call, the integrity report after)."""
    client, app = build(EngineConfig(), cfg)
    calls: list[int] = []
    real = app.state.engine.features

    async def features(audio):
        calls.append(audio.num_samples)
        return await real(audio)

    app.state.engine.features = features
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        texts = {}
        with httpx.Client(base_url=server.url, timeout=300) as http:
            for name, data in uploads.items():
                r = http.post("/v1/audio/transcriptions", files={"file": (f"{name}.wav", data)},
                              data={"model": "whisper-1"})
                assert r.status_code == 200, r.text
                texts[name] = r.json()["text"]
            r = http.post("/v1/audio/transcriptions", files={"file": ("jfk.wav", uploads["jfk"])},
                          data={"model": "whisper-1", "response_format": "verbose_json",
                                "timestamp_granularities[]": ["word", "segment"]})
            assert r.status_code == 200, r.text
            body = r.json()  # word times read from the cross-attention of the window's K/V
            texts["words"] = [(w["word"], w["start"], w["end"]) for w in body["words"]]
            texts["segments"] = [(s["start"], s["end"], s["text"]) for s in body["segments"]]
        return texts, calls, asyncio.run(app.state.engine.integrity())
    finally:
        server.stop()
        client.shutdown(5.0)


@pytest.fixture(scope="module")
def host_texts(uploads) -> dict[str, str]:
    texts, calls, _ = _serve(ServerConfig(audio_workers=1), uploads)  # the CPU default
    assert calls == []
    return texts


@pytest.mark.parametrize("engine_process", [True, False], ids=["worker", "in-process"])
def test_short_uploads_are_featurized_in_the_step_with_the_host_texts(uploads, host_texts,
                                                                      engine_process):
    cfg = ServerConfig(step_features=True, audio_workers=1, engine_process=engine_process)
    texts, calls, report = _serve(cfg, uploads)
    assert texts == host_texts and all(texts.values()) and len(texts["words"]) > 10
    assert len(calls) == 1 and calls[0] > 30 * 16000  # only the long upload, on the device
    assert report["ok"] and report["kv_slots_used"] == 0


def test_the_policy_decodes_every_upload_and_needs_device_log_mels():
    policy = FeaturePolicy(30.0, 0, in_step=True)
    with policy.track(), policy.track(), policy.track():
        assert policy.defer_above_s() == 0.0  # busy or not: decoded only
    assert FeaturePolicy(30.0, 0).in_step is False
    with pytest.raises(ValueError, match="prefill step"):
        FeaturePolicy(None, 0, in_step=True)
    assert ServerConfig(step_features=True).device_features_threshold("cpu") == 30.0
    assert ServerConfig().step_features_on("cuda") and not ServerConfig().step_features_on("cpu")
    assert not ServerConfig(step_features=False).step_features_on("cuda")
    host_only = ServerConfig(device_features_above_s=-1)  # every log-mel on the workers
    assert not host_only.step_features_on("cuda")
    assert host_only.device_features_threshold("cuda") is None
    assert ServerConfig().device_features_threshold("cpu") is None
    with pytest.raises(ValueError, match="--step-features"):
        ServerConfig(step_features=True, device_features_above_s=-1)
