"""``/v1/chat/completions`` on a live server (tiny random Mllama, uvicorn on 127.0.0.1:<ephemeral>)
through the official ``openai`` client: image + text, streaming, limits, usage, stop strings,
concurrency, bad inputs (4xx in OpenAI's shape; the server keeps serving), KV integrity."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edserve.chat.chat_api import chat, prepare_chat
from edserve.chat.mllama_chat import ChatTokenizer
from edserve.config import EngineConfig
from edserve.runtime import build_engine
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests.models.mllama.chat_tiny import png_data_url, save_chat_model  # noqa: E402
from tests.multimodal.test_input_validation import huge_png_url  # noqa: E402

MODEL, KEY = "tiny-mllama", "chat-key"
ENGINE = dict(device="cpu", dtype="float32", context_length=128, max_running_requests=4)
IMG = png_data_url(100, 50)  # 2 tiles at 56 px


def _image_msg(text: str = "describe the image", url: str = IMG) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


TEXT_MSG = [{"role": "user", "content": "what is this"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat_mllama"))


@pytest.fixture(scope="module")
def server(folder):
    cfg = ServerConfig(api_key=KEY, served_model_name=MODEL, enable_debug_endpoints=True,
                       debug_rate_limit=100.0)
    aengine, app = build(EngineConfig(model=str(folder), **ENGINE), cfg)
    srv = ServerThread(app, "127.0.0.1", 0).start()
    srv.aengine = aengine
    yield srv
    srv.stop()
    aengine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def local(folder):
    """The same model in a synchronous engine, for the Python API."""
    return build_engine(model=str(folder), **ENGINE)


def _create(client, messages, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _stream(client, messages, **kw) -> tuple[str, str, object]:
    chunks = list(_create(client, messages, stream=True,
                          stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks[-1].usage


def _idle_integrity(http: httpx.Client) -> dict:
    for _ in range(300):
        report = http.get("/debug/integrity").json()
        assert report.get("ok"), report
        if report["inflight"] == report["running"] == report["waiting"] == 0:
            assert report["kv_slots_used"] == 0, report
            return report
        time.sleep(0.05)
    raise AssertionError(f"engine never became idle: {report}")


@pytest.mark.parametrize("messages", [_image_msg(), TEXT_MSG], ids=["image", "text"])
def test_stream_equals_non_stream_equals_python_api(client, local, messages):
    res = _create(client, messages, max_tokens=12)
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    assert res.model == MODEL and res.created > 0
    choice = res.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    ref = chat(local, messages, max_tokens=12)
    assert choice.message.content == ref.text and ref.completion_tokens == 12
    assert res.usage.prompt_tokens == ref.prompt_tokens == (12 if len(messages[0]["content"])
                                                            == 2 else 25)
    assert res.usage.completion_tokens == 12 and res.usage.total_tokens == ref.prompt_tokens + 12
    text, finish, usage = _stream(client, messages, max_tokens=12)
    assert (text, finish) == (ref.text, "length")
    assert usage.completion_tokens == 12 and usage.prompt_tokens == ref.prompt_tokens


def test_max_completion_tokens_and_stop_string(client, local):
    res = _create(client, TEXT_MSG, max_completion_tokens=3)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 3
    text = chat(local, TEXT_MSG, max_tokens=12).text
    full = text.split(" ")
    stop = full[2]  # cut right before the first occurrence of the third word
    want = text[:text.index(stop)]
    res = _create(client, TEXT_MSG, max_tokens=12, stop=[stop, "never-seen"])
    assert (res.choices[0].message.content, res.choices[0].finish_reason) == (want, "stop")
    assert res.usage.completion_tokens == full.index(stop) + 1
    text, finish, _ = _stream(client, TEXT_MSG, max_tokens=12, stop=stop)
    assert (text, finish) == (want, "stop")


def _engine_logprobs(local, messages, max_tokens: int) -> tuple[list[int], list[float]]:
    request, _ = prepare_chat(local, messages, max_tokens=max_tokens)
    out = local.generate([request])[0]
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("messages", [_image_msg(), TEXT_MSG], ids=["image", "text"])
def test_logprobs_are_the_engines_per_token(client, local, messages):
    """``logprobs: true``: one entry per completion token, the engine's log-probability of
    that token, its text decoded alone; the same entries streamed, chunk by chunk."""
    ids, lps = _engine_logprobs(local, messages, 8)
    tok = ChatTokenizer.for_model(local.model, local.tokenizer)
    res = _create(client, messages, max_tokens=8, logprobs=True)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 8
    assert [e.token for e in content] == [tok.decode([t]) for t in ids]
    assert [e.logprob for e in content] == pytest.approx(lps, abs=1e-5)
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in content)
    assert all(bytes(e.bytes).decode() == e.token for e in content)
    chunks = list(_create(client, messages, max_tokens=8, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = _create(client, messages, max_tokens=8)
    assert plain.choices[0].logprobs is None  # only when asked
    assert plain.choices[0].message.content == res.choices[0].message.content


@pytest.mark.parametrize("messages", [_image_msg(), TEXT_MSG], ids=["image", "text"])
def test_top_logprobs_are_the_engines_alternatives(client, local, messages):
    """``top_logprobs: k``: every entry lists the engine's k most likely tokens at that
    position (greedy: the chosen token first, with its own log-probability), decoded alone,
    best first; the same streamed."""
    request, tok = prepare_chat(local, messages, max_tokens=6, top_logprobs=3)
    out = local.generate([request])[0]
    res = _create(client, messages, max_tokens=6, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == 6
    for e, alternatives in zip(content, out.top_logprobs, strict=True):
        assert [a.token for a in e.top_logprobs] == [tok.decode([t]) for t, _ in alternatives]
        assert [a.logprob for a in e.top_logprobs] == \
            pytest.approx([lp for _, lp in alternatives], abs=1e-5)
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        lps = [a.logprob for a in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    chunks = list(_create(client, messages, max_tokens=6, logprobs=True, top_logprobs=3,
                          stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [[a.token for a in e.top_logprobs] for e in streamed] == \
        [[a.token for a in e.top_logprobs] for e in content]
    py = chat(local, messages, max_tokens=6, top_logprobs=3)  # the Python API returns them
    assert py.token_ids == out.token_ids and py.top_logprobs == out.top_logprobs
    assert py.logprobs == out.logprobs


def test_logprobs_end_with_the_stop_string(client, local):
    text = chat(local, TEXT_MSG, max_tokens=12).text
    stop = text.split(" ")[2]
    res = _create(client, TEXT_MSG, max_tokens=12, stop=stop, logprobs=True)
    content = res.choices[0].logprobs.content
    assert res.choices[0].finish_reason == "stop"
    assert len(content) == res.usage.completion_tokens and content[-1].token == stop
    py = chat(local, TEXT_MSG, max_tokens=12, stop=stop, top_logprobs=2)
    assert len(py.logprobs) == len(py.top_logprobs) == py.completion_tokens == len(content)
    assert py.logprobs == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_logit_bias_and_penalties(client, local):
    """+100 on one word makes greedy decoding repeat it; the penalties reach the engine as
    filters (the same text as the local engine given them) and change what it picks."""
    cat = ChatTokenizer.for_model(local.model, local.tokenizer).encode("cat")[0]
    res = _create(client, TEXT_MSG, max_tokens=4, logit_bias={str(cat): 100})
    assert res.choices[0].message.content == "cat cat cat cat"
    kw = dict(frequency_penalty=2.0, presence_penalty=2.0)
    res = _create(client, TEXT_MSG, max_tokens=12, logit_bias={str(cat): 10}, **kw)
    request, tok = prepare_chat(local, TEXT_MSG, max_tokens=12, logit_bias={cat: 10}, **kw)
    out = local.generate([request])[0]
    assert res.choices[0].message.content == tok.decode(out.token_ids)
    assert chat(local, TEXT_MSG, max_tokens=12, logit_bias={cat: 10}, **kw).token_ids \
        == out.token_ids  # the Python API takes them too
    unpenalized = _create(client, TEXT_MSG, max_tokens=12, logit_bias={str(cat): 10})
    assert unpenalized.choices[0].message.content == " ".join(["cat"] * 12)
    assert 1 <= out.token_ids.count(cat) < 12  # the penalties outgrow the bias after a few


def test_seeded_sampling_is_reproducible(client):
    a = _create(client, _image_msg(), max_tokens=8, temperature=1.5, seed=7)
    b = _create(client, _image_msg(), max_tokens=8, temperature=1.5, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_mixed_concurrent_requests_match_solo(client, http):
    cases = [_image_msg("describe the image"), TEXT_MSG,
             _image_msg("what is this", png_data_url(300, 40, 1)),
             [{"role": "user", "content": "hello world"}],
             _image_msg("a red cat", png_data_url(120, 120, 2)), TEXT_MSG]
    solo = [_create(client, m, max_tokens=10).choices[0].message.content for m in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        futs = [pool.submit(_create, client, m, max_tokens=10) for m in cases]
        together = [f.result().choices[0].message.content for f in futs]
    assert together == solo
    _idle_integrity(http)


BAD = {
    "remote URL": (dict(messages=_image_msg(url="https://example.com/cat.png")),
                   "remote image URLs are refused"),
    "local path": (dict(messages=_image_msg(url="/etc/hostname")), "must be a data: URL"),
    "undecodable": (dict(messages=_image_msg(url="data:image/png;base64,aGVsbG8=")),
                    "cannot decode image"),
    "too many images": (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMG}}] * 5}]), "too many images"),
    "system + image": (dict(messages=[{"role": "system", "content": "be brief"}]
                            + _image_msg()), "incompatible with system messages"),
    "image token in text": (dict(messages=[{"role": "user", "content": "a <|image|> b"}]),
                            "must match"),
    "temperature 3": (dict(messages=TEXT_MSG, temperature=3), "'temperature'"),
    "max_tokens 0": (dict(messages=TEXT_MSG, max_tokens=0), "'max_tokens'"),
    "max_tokens past the context": (dict(messages=TEXT_MSG, max_tokens=200),
                                    "max_tokens 200 exceeds what the context leaves: 128"),
    "missing messages": (dict(), "'messages' is required"),
    "bad role": (dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
    "bad part": (dict(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
                 "unsupported content part"),
    "n=17": (dict(messages=TEXT_MSG, n=17), "'n' must be an integer in [1, 16]"),
    "stop list": (dict(messages=TEXT_MSG, stop=[""]), "'stop'"),
    "too long": (dict(messages=[{"role": "user", "content": "cat " * 200}]), "positions"),
    "stop number": (dict(messages=TEXT_MSG, stop=5), "'stop' must be a string"),
    "stop dict": (dict(messages=TEXT_MSG, stop={"a": 1}), "'stop' must be a string"),
    "messages string": (dict(messages="hi"), "'messages'"),
    "role list": (dict(messages=[{"role": ["user"], "content": "hi"}]), "role must be one of"),
    "max_tokens string": (dict(messages=TEXT_MSG, max_tokens="5"), "'max_tokens'"),
    "top_p list": (dict(messages=TEXT_MSG, top_p=[1]), "'top_p'"),
    "include_usage string": (dict(messages=TEXT_MSG, stream=True,
                                  stream_options={"include_usage": "yes"}), "include_usage"),
    "seed 2**70": (dict(messages=TEXT_MSG, seed=2**70), "'seed' must be an integer in"),
    "huge png": (dict(messages=_image_msg(url=huge_png_url())),
                 "13000x13000 pixels; the limit is 40 megapixels"),
    # fields that would change the output and are not implemented: refused, not ignored
    "logprobs string": (dict(messages=TEXT_MSG, logprobs="yes"), "'logprobs' must be a boolean"),
    "top_logprobs alone": (dict(messages=TEXT_MSG, top_logprobs=2),
                           "'top_logprobs' needs 'logprobs': true"),
    "top_logprobs 21": (dict(messages=TEXT_MSG, logprobs=True, top_logprobs=21),
                        "'top_logprobs' must be an integer in [0, 20]"),
    "top_logprobs float": (dict(messages=TEXT_MSG, logprobs=True, top_logprobs=2.0),
                           "'top_logprobs' must be an integer"),
    "frequency_penalty 3": (dict(messages=TEXT_MSG, frequency_penalty=3),
                            "'frequency_penalty' must be a number in [-2.0, 2.0]"),
    "presence_penalty string": (dict(messages=TEXT_MSG, presence_penalty="1"),
                                "'presence_penalty'"),
    "logit_bias list": (dict(messages=TEXT_MSG, logit_bias=[5]), "'logit_bias' must be an"),
    "logit_bias key": (dict(messages=TEXT_MSG, logit_bias={"cat": 1}), "keys must be token ids"),
    "logit_bias 500": (dict(messages=TEXT_MSG, logit_bias={"5": 500}), "values must be numbers"),
    "logit_bias id": (dict(messages=TEXT_MSG, logit_bias={"99999": 1}),
                      "outside the vocabulary (0..127)"),
    # JSON mode is implemented (test_chat_json.py); this word-level test vocabulary has no
    # byte-level decoder llguidance can read, so it is refused up front rather than ignored
    "json mode": (dict(messages=TEXT_MSG, response_format={"type": "json_object"}),
                  "structured output cannot use this model's tokenizer"),
    "tool_choice": (dict(messages=TEXT_MSG, tool_choice="auto"), "'tool_choice'"),
}


def test_unsupported_fields_at_their_no_op_values_are_accepted(http):
    body = dict(model=MODEL, messages=TEXT_MSG, max_tokens=2, logprobs=False, top_logprobs=0,
                frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                response_format={"type": "text"}, tool_choice="none")
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_are_4xx_with_openai_shape(http, name):
    body, needle = BAD[name]
    r = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and needle in err["message"], err
    assert not re.search(r"0x[0-9a-f]{6,}|object at", err["message"]), err
    assert len(err["message"]) < 300, err


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_400(http, depth):
    raw = f'{{"model": "{MODEL}", "messages": {"[" * depth + "]" * depth}}}'
    r = http.post("/v1/chat/completions", content=raw.encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nests deeper than" in r.json()["error"]["message"]


def test_errors_through_openai_client_then_still_serving(server, client, http):
    with pytest.raises(openai.BadRequestError, match="incompatible with system"):
        _create(client, [{"role": "system", "content": "x"}] + _image_msg())
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=TEXT_MSG)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).chat.completions.create(model=MODEL, messages=TEXT_MSG)
    assert http.post("/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"}).status_code == 400
    assert _create(client, _image_msg(), max_tokens=2).usage.completion_tokens == 2
    _idle_integrity(http)


def test_audio_route_on_mllama_is_400(http):
    r = http.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")},
                  data={"model": MODEL})
    assert r.status_code == 400 and "does not take audio" in r.json()["error"]["message"]


def test_client_disconnect_aborts_and_frees_kv(server, http):
    before = server.aengine.engine.scheduler.num_generated_tokens
    body = {"model": MODEL, "messages": _image_msg(), "max_tokens": 100, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the role chunk, then hang up mid-generation
    _idle_integrity(http)
    generated = server.aengine.engine.scheduler.num_generated_tokens - before
    assert generated < 100  # aborted: it never ran to max_tokens


def test_chat_on_whisper_server_is_400():
    """A Whisper engine (tiny.en) behind the app: the chat route refuses with a clear 400."""
    from fastapi.testclient import TestClient

    from edserve.engine.async_engine import AsyncEngine
    from edserve.server.app import create_app

    aengine = AsyncEngine(build_engine(EngineConfig(device="cpu", max_running_requests=1)))
    with TestClient(create_app(aengine, ServerConfig()), base_url="http://localhost") as tc:
        r = tc.post("/v1/chat/completions", json={"model": "whisper-1", "messages": TEXT_MSG})
    assert r.status_code == 400
    assert "Whisper" in r.json()["error"]["message"]


def test_chat_responses_match_served_schema(http):
    """The completion, the stream (chunks, usage chunk, [DONE]) and an error match the
    /openapi.json this server serves."""
    from .openapi_check import check_response

    doc = http.get("/openapi.json").json()
    path = "/v1/chat/completions"
    body = {"model": MODEL, "messages": _image_msg(), "max_tokens": 4, "temperature": 0}
    out = check_response(doc, path, "post", http.post(path, json=body))
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    r = http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = check_response(doc, path, "post", r)
    assert r.text.rstrip().endswith("data: [DONE]") and events[-1]["usage"]["total_tokens"] > 0
    r = http.post(path, json={**body, "temperature": 5})
    assert r.status_code == 400
    assert check_response(doc, path, "post", r)["error"]["param"] == "temperature"
    _idle_integrity(http)
