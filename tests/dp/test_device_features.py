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

from dp.reference import DATA, wait_for
from edserve.audio.decode import load_audio
from edserve.audio.held_mel import HeldMel
from edserve.audio.mel import window_features
from edserve.audio.prepare import DecodedAudio, PreparedAudio, longform_compact_mel
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.engine.request import GenerateRequest, SamplingParams
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


def _serve(server_cfg: ServerConfig, uploads: dict[str, bytes], patch=None,
           after=None) -> dict[str, str]:
    client, app = build(EngineConfig(), server_cfg)
    if patch is not None:
        patch(app.state.engine)
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        texts = _texts(server.url, uploads)
        if after is not None:
            after(app.state.engine)
        return texts
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


@pytest.mark.parametrize("held_mb", [4096, 0])
def test_engine_process_computes_long_log_mels_with_the_same_text(uploads, host_texts, held_mb):
    """The engine worker keeps the long upload's log-mel (its windows refer to it) and drops
    it when the transcription ends; with ``--held-log-mel-mb 0`` it sends the values back
    (the same texts either way)."""
    def nothing_held(client):
        assert isinstance(client, DataParallelClient)
        wait_for(lambda: _held_mels(client) == 0, 30, "the held log-mels to be released")
        assert len(client.supervisor.mels) == 0
        report = asyncio.run(client.integrity())
        assert report["ok"] and report["kv_slots_used"] == 0 and report["held_log_mels"] == 0

    texts = _serve(ServerConfig(engine_process=True, audio_workers=1, held_log_mel_mb=held_mb,
                                device_features_above_s=5.0), uploads, after=nothing_held)
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


def test_a_stream_left_after_its_first_segment_releases_the_log_mel(uploads):
    """A client that reads one streamed segment of a long upload and hangs up: the log-mel
    the worker held for it is released, the KV slots are freed and the pools intact."""
    cfg = ServerConfig(engine_process=True, audio_workers=1, device_features_above_s=5.0)
    client, app = build(EngineConfig(), cfg)
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            with http.stream("POST", "/v1/audio/transcriptions",
                             files={"file": ("long.wav", uploads["long"])},
                             data={"model": "whisper-1", "stream": "true"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if "transcript.text.delta" in line:
                        assert _held_mels(client) == 1  # the windows read it there
                        break  # leave: the connection closes
        wait_for(lambda: _held_mels(client) == 0, 60, "the held log-mel to be released")
        wait_for(lambda: asyncio.run(client.integrity())["kv_slots_used"] == 0, 60,
                 "the aborted window's KV slots")
        report = asyncio.run(client.integrity())
        assert report["ok"] and report["held_log_mels"] == 0
        assert report["workers"][0]["held_log_mels"] == 0
    finally:
        server.stop()
        client.shutdown(5.0)


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


def _held_mels(client) -> int:
    return client.supervisor.call(client.workers[0], "encoder").result(60)["mels"]


def test_worker_features_call_keeps_the_log_mel_there_and_a_bad_one():
    """The log-mel stays in the worker (the answer is a HeldMel); a window request on it
    decodes the same tokens as one carrying the window's values; released explicitly or as a
    cancelled call's answer, nothing stays held; a bad call leaves the worker serving."""
    client = DataParallelClient(EngineConfig(), 1).start()
    try:
        audio = load_audio(DATA / "jfk.wav")
        values = longform_compact_mel(audio, 80)

        def request(mel):
            tok = client.tokenizer
            return GenerateRequest(tok.sot_sequence("en", "transcribe", False),
                                   window_features(mel, 0, 1100, "silence"),
                                   SamplingParams(max_new_tokens=30))

        async def go():
            good = await client.features(DecodedAudio(audio, 0.5))
            w = client.workers[0]
            bad = asyncio.wrap_future(client.supervisor.call(w, "features", "not audio"))
            with pytest.raises(RuntimeError, match="TypeError: features takes DecodedAudio"):
                await bad
            assert _held_mels(client) == 1
            held_out = await client.generate(request(good.mel))
            values_out = await client.generate(request(values))
            cancelled = client.supervisor.call(w, "features", DecodedAudio(audio))
            assert cancelled.cancel()  # its answer arrives after: nobody takes it
            good.mel.release()
            return good, held_out, values_out, await client.integrity()

        good, held_out, values_out, report = asyncio.run(go())
        assert isinstance(good, PreparedAudio) and good.decode_s == 0.5
        assert good.num_samples == len(audio) and good.features_s > 0
        assert isinstance(good.mel, HeldMel) and good.mel.shape == values.shape
        assert held_out.token_ids == values_out.token_ids and len(held_out.token_ids) > 5
        assert report["ok"] and report["workers"][0]["ok"]  # still serving
        wait_for(lambda: _held_mels(client) == 0, 30, "the held log-mels to be released")
        assert len(client.supervisor.mels) == 0
        with pytest.raises(ValueError, match="not held"):  # released: its windows are refused
            asyncio.run(client.generate(request(good.mel)))
    finally:
        client.shutdown(5.0)
