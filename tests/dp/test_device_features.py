"""``--device-features-above-s``: a long upload's log-mel computed by the engine's client (a
thread of the engine worker process, or of the in-process engine) instead of an audio worker.
The texts equal the host path's, a failing ``features`` call falls back to the host, and a bad
call leaves the worker serving (CPU, tiny.en)."""

from __future__ import annotations

import asyncio
import io
import wave

import httpx
import numpy as np
import pytest
import torch

from dp.reference import DATA
from edserve.audio.decode import load_audio
from edserve.audio.prepare import DecodedAudio, PreparedAudio, longform_mel
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

PIECES = ("jfk", "cards_005", "librivox_0870", "jfk")


def _wav(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def uploads() -> dict[str, bytes]:
    """An 11 s clip and a > 30 s file (several windows)."""
    pause = np.zeros(8000, np.float32)
    long = np.concatenate([x for c in PIECES for x in (load_audio(DATA / f"{c}.wav"), pause)])
    assert len(long) > 30 * 16000
    return {"jfk": (DATA / "jfk.wav").read_bytes(), "long": _wav(long)}


def _texts(url: str, uploads: dict[str, bytes]) -> dict[str, str]:
    out = {}
    with httpx.Client(base_url=url, timeout=300) as http:
        for name, data in uploads.items():
            r = http.post("/v1/audio/transcriptions", files={"file": (f"{name}.wav", data)},
                          data={"model": "whisper-1"})
            assert r.status_code == 200, r.text
            out[name] = r.json()["text"]
    return out


def _serve(server_cfg: ServerConfig, uploads: dict[str, bytes], patch=None) -> dict[str, str]:
    client, app = build(EngineConfig(), server_cfg)
    if patch is not None:
        patch(app.state.engine)
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        return _texts(server.url, uploads)
    finally:
        server.stop()
        client.shutdown(5.0)


@pytest.fixture(scope="module")
def host_texts(uploads) -> dict[str, str]:
    """The reference: every log-mel on the audio workers (the CPU default)."""
    assert ServerConfig().device_features_threshold("cpu") is None
    return _serve(ServerConfig(audio_workers=0), uploads)


def test_threshold_resolution():
    assert ServerConfig().device_features_threshold("cuda") == 30.0
    assert ServerConfig(device_features_above_s=-1).device_features_threshold("cuda") is None
    assert ServerConfig(device_features_above_s=5).device_features_threshold("cpu") == 5


def test_engine_process_computes_long_log_mels_with_the_same_text(uploads, host_texts):
    texts = _serve(ServerConfig(engine_process=True, audio_workers=1,
                                device_features_above_s=5.0), uploads)
    assert texts == host_texts


def _spy(calls: list[int]):
    """A ``_serve`` patch that records the samples of every ``features`` call."""
    def patch(client):
        real = client.features

        async def features(audio):
            calls.append(audio.num_samples)
            return await real(audio)

        client.features = features
    return patch


def test_in_process_engine_computes_them_too(uploads, host_texts):
    calls = []
    texts = _serve(ServerConfig(audio_workers=0, device_features_above_s=20.0), uploads,
                   _spy(calls))
    assert texts == host_texts
    assert len(calls) == 1 and calls[0] > 20 * 16000  # only the long upload was deferred


def test_an_idle_server_computes_every_log_mel_on_the_device(uploads, host_texts):
    calls = []
    # one request at a time: in flight 1 <= --device-features-idle 1, so the 11 s clip too
    texts = _serve(ServerConfig(audio_workers=1, device_features_above_s=20.0,
                                device_features_idle=1), uploads, _spy(calls))
    assert texts == host_texts
    assert len(calls) == 2 and min(calls) < 12 * 16000


def test_a_failing_features_call_falls_back_to_the_host(uploads, host_texts):
    def broken(client):
        async def features(audio):
            raise RuntimeError("device out of memory (simulated)")

        client.features = features

    texts = _serve(ServerConfig(audio_workers=0, device_features_above_s=5.0), uploads, broken)
    assert texts == host_texts


def test_worker_features_call_and_a_bad_one():
    client = DataParallelClient(EngineConfig(), 1).start()
    try:
        audio = load_audio(DATA / "jfk.wav")

        async def go():
            good = await client.features(DecodedAudio(audio, 0.5))
            w = client.workers[0]
            bad = asyncio.wrap_future(client.supervisor.call(w, "features", "not audio"))
            with pytest.raises(RuntimeError, match="TypeError: features takes DecodedAudio"):
                await bad
            return good, await client.integrity()

        good, report = asyncio.run(go())
        assert isinstance(good, PreparedAudio) and good.decode_s == 0.5
        assert good.num_samples == len(audio) and good.features_s > 0
        torch.testing.assert_close(good.mel.full(), longform_mel(audio, 80), rtol=0, atol=1e-6)
        assert report["ok"] and report["workers"][0]["ok"]  # still serving
    finally:
        client.shutdown(5.0)
