"""``include[]=logprobs`` on ``/v1/audio/transcriptions``: one ``{token, logprob, bytes}``
entry per text token of ``text`` (json, streamed or not), the engine's own log-probabilities
(an oracle drives the same window on a separate engine), the same through the engine worker
process, the official ``openai`` client's ``.logprobs``, and 400 naming ``include[]`` for the
formats OpenAI does not give them with."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.runtime import build_engine
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build
from edserve.server.params import TranscriptionParams
from edserve.server.transcription import build_options
from edserve.whisper.transcribe import make_task

from .server_helpers import DATA, integrity

TRANSCRIBE = "/v1/audio/transcriptions"
EOT = 50256  # tiny.en's <|endoftext|>: text tokens are below it


def _post(http: httpx.Client, path, fields: dict) -> httpx.Response:
    files = {"file": (path.name, path.read_bytes(), "audio/wav")}
    return http.post(TRANSCRIBE, data={"model": "whisper-1", **fields}, files=files)


def _json(http, path) -> dict:
    r = _post(http, path, {"include[]": "logprobs"})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, path) -> list[dict]:
    r = _post(http, path, {"include[]": "logprobs", "stream": "true"})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def _check_entries(body: dict) -> None:
    """Every entry is {token, logprob, bytes}, logprob finite and <= 0; the bytes join to
    the text before its strip (Whisper's text starts with a space), and so do the token
    strings here (English clips: no token is a piece of a multi-byte character)."""
    entries, text = body["logprobs"], body["text"]
    assert entries and all(set(e) == {"token", "logprob", "bytes"} for e in entries)
    assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in entries)
    joined = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8")
    assert joined.strip() == text and joined.startswith(" ")
    assert "".join(e["token"] for e in entries) == joined


def _oracle(path) -> list[tuple[int, float]]:
    """(token, log-probability) of the text tokens of the accepted attempt of each window,
    straight from the engine's outputs, on a separate engine with the server's options
    (short clips: one window without timestamps, so every text token is in the text)."""
    engine = build_engine(EngineConfig(max_running_requests=4))
    params = TranscriptionParams(b"", "x.wav", "whisper-1", None, None, "json", 0.0, (), False)
    task = make_task(engine, load_audio(path),
                     build_options(params, "transcribe", ServerConfig(), engine.config.seed))
    assert not task.timestamps and task.content_frames <= 3000
    got: list[tuple[int, float]] = []
    outs: list = []
    while (req := task.next_request()) is not None:
        engine.add_request(req, lambda d: outs.append(d.output) if d.finished else None)
        while engine.has_work():
            engine.step()
        out = outs.pop()
        if task.feed(out):  # accepted (not a fallback retry)
            got += [(t, lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True)
                    if t < EOT]
        for handle in task.take_released():
            engine.release_encoder(handle)
    for handle in task.abandon():
        engine.release_encoder(handle)
    return got


@pytest.fixture(scope="module")
def oracles() -> dict[str, list[tuple[int, float]]]:
    return {c: _oracle(DATA / f"{c}.wav") for c in ("jfk", "cards_005")}


@pytest.fixture(scope="module")
def worker_url():
    """A server whose engine runs in an engine worker process (outputs pickled across)."""
    client, app = build(EngineConfig(), ServerConfig(engine_process=True))
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        yield server.url
    finally:
        server.stop()
        client.shutdown(5.0)


@pytest.fixture(scope="module")
def tok():
    from edserve.models.weights import default_model_folder
    from edserve.tokenizer import WhisperTokenizer

    return WhisperTokenizer.from_file(default_model_folder() / "tokenizer.json", 51864)


@pytest.mark.parametrize("clip", ["jfk", "cards_005"])
def test_json_logprobs_are_the_engines(http, oracles, tok, clip):
    body = _json(http, DATA / f"{clip}.wav")
    assert set(body) == {"text", "logprobs", "usage"}
    _check_entries(body)
    expected = oracles[clip]
    assert [e["token"] for e in body["logprobs"]] == [tok.decode([t]) for t, _ in expected]
    assert [e["bytes"] for e in body["logprobs"]] == [list(tok.token_bytes(t))
                                                      for t, _ in expected]
    for e, (_, lp) in zip(body["logprobs"], expected, strict=True):
        assert e["logprob"] == pytest.approx(lp, abs=2e-3)


def test_long_form_stream_equals_json_and_follows_the_segments(http, tok, long_clip):
    """Across windows: one entry per text token of verbose_json's segments (the same decode),
    and the stream's deltas carry exactly the non-streamed list, split by segment."""
    path = long_clip[0]
    body = _json(http, path)
    _check_entries(body)
    verbose = _post(http, path, {"response_format": "verbose_json"}).json()
    text_tokens = [t for s in verbose["segments"] for t in s["tokens"] if t < EOT]
    assert verbose["text"] == body["text"]
    assert [e["token"] for e in body["logprobs"]] == [tok.decode([t]) for t in text_tokens]
    events = _stream(http, path)
    deltas, done = events[:-1], events[-1]
    assert len(deltas) > 2 and all(e["type"] == "transcript.text.delta" for e in deltas)
    assert done["type"] == "transcript.text.done" and done["text"] == body["text"]
    assert set(done) == {"type", "text", "logprobs", "usage"}
    assert [x for e in deltas for x in e["logprobs"]] == done["logprobs"] == body["logprobs"]
    for e in deltas:  # each delta's entries spell its text (up to whitespace at the seams)
        assert "".join(x["token"] for x in e["logprobs"]).strip() == e["delta"].strip()
    integrity(http)


def test_engine_worker_process_answers_alike(http, worker_url):
    path = DATA / "jfk.wav"
    reference = _json(http, path)
    with httpx.Client(base_url=worker_url, timeout=300) as other:
        body = _json(other, path)
        events = _stream(other, path)
    assert body["text"] == reference["text"]
    assert [e["token"] for e in body["logprobs"]] == [e["token"] for e in reference["logprobs"]]
    for a, b in zip(body["logprobs"], reference["logprobs"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=2e-3)
    assert [x for e in events[:-1] for x in e["logprobs"]] == events[-1]["logprobs"] \
        == body["logprobs"]


def test_openai_client_include_logprobs(client):
    with open(DATA / "cards_005.wav", "rb") as f:
        result = client.audio.transcriptions.create(model="whisper-1", file=f,
                                                    include=["logprobs"])
    assert result.logprobs and "spades" in result.text
    assert "".join(p.token for p in result.logprobs).strip() == result.text
    assert all(p.logprob <= 0 and p.bytes == list(p.token.encode()) for p in result.logprobs)
    with open(DATA / "cards_005.wav", "rb") as f:
        events = list(client.audio.transcriptions.create(
            model="whisper-1", file=f, include=["logprobs"], stream=True))
    assert [p.token for e in events[:-1] for p in e.logprobs] \
        == [p.token for p in events[-1].logprobs] == [p.token for p in result.logprobs]
    with open(DATA / "cards_005.wav", "rb") as f:  # not asked: no logprobs
        assert client.audio.transcriptions.create(model="whisper-1", file=f).logprobs is None


@pytest.mark.parametrize("fields", [
    {"include[]": "logprobs", "response_format": fmt}
    for fmt in ("text", "srt", "vtt", "verbose_json")] + [
    {"include[]": "logprobs", "response_format": "text", "stream": "true"},
    {"include[]": "tokens"}, {"include": "logprobs", "response_format": "srt"},
    {"include[]": ["logprobs", "nope"]},
])
def test_bad_combinations_name_include(http, fields):
    r = _post(http, DATA / "cards_005.wav", fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "include[]"
