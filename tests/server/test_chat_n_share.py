"""A chat completion's ``n`` choices share one vision-encoder run
(``edserve.server.encoder_share``), on a live server in process and through an engine worker
process, with the official ``openai`` client: the image is encoded once for n = 3 (and sent
once: the siblings are submitted without it), every choice's text is what it gives as a
request of its own (seed + index), streamed or not; no path (success, a client gone
mid-stream, choice 0 failing before or after it handed the region over, a sibling failing, a
stop string aborting choices, a delta nobody read) leaves a held encoder handle or a used KV
slot."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import httpx
import pytest

from edserve.chat.chat_api import chat, prepare_chat
from edserve.engine.errors import RequestFailed
from edserve.runtime import build_engine

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests.models.mllama.chat_tiny import png_data_url, save_chat_model  # noqa: E402
from tests.server.server_helpers import chat_server, openai_client  # noqa: E402
from tests.server.test_chat import _idle_integrity  # noqa: E402

MODEL = "tiny-share"
ENGINE = dict(device="cpu", dtype="float32", context_length=128, max_running_requests=4)
IMAGE_MSG = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": png_data_url(100, 50)}},
    {"type": "text", "text": "describe the image"}]}]
TEXT_MSG = [{"role": "user", "content": "what is this"}]
SAMPLED = dict(max_tokens=10, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("share_chat"))


@pytest.fixture(scope="module")
def local(folder):
    return build_engine(model=str(folder), **ENGINE)


@pytest.fixture(scope="module", params=["in_process", "engine_process"])
def server(request, folder):
    with chat_server(folder, MODEL, ENGINE, request.param == "engine_process") as (
            srv, engine, app):
        yield SimpleNamespace(url=srv.url, client=app.state.engine, engine=engine)


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def encoder_counts(server) -> dict:
    """``encoded``: encoder inputs the engine ran; ``held``: encoder handles it holds."""
    client = server.client
    if hasattr(client, "supervisor"):  # engine worker process(es)
        counts = [client.supervisor.call(w, "encoder").result(60) for w in client.workers]
        assert len(client.supervisor.handles) == sum(c["held"] for c in counts)
        return {k: sum(c[k] for c in counts) for k in ("encoded", "held")}
    engine = server.engine.engine
    return {"encoded": engine.runner.num_encoded_inputs, "held": len(engine.scheduler.held)}


def assert_clean(server, http) -> None:
    """Idle: the KV cache whole and empty, no encoder handle held (in either process)."""
    _idle_integrity(http)
    for _ in range(100):  # a release travels after the last delta
        if encoder_counts(server)["held"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"encoder handles still held: {encoder_counts(server)}")


def _texts(chunks, n: int) -> tuple[list[str], list]:
    texts, finish = [""] * n, [None] * n
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    return texts, finish


def test_n_choices_encode_the_image_once_and_equal_solo_requests(server, oai, http, local):
    refs = [chat(local, IMAGE_MSG, seed=SAMPLED["seed"] + i, max_tokens=10, temperature=1.0)
            for i in range(3)]
    assert len({r.text for r in refs}) > 1  # the choices differ: seed + index
    before = encoder_counts(server)["encoded"]
    res = oai.chat.completions.create(model=MODEL, messages=IMAGE_MSG, n=3, **SAMPLED)
    assert encoder_counts(server)["encoded"] == before + 1  # one vision run, not three
    assert [c.message.content for c in res.choices] == [r.text for r in refs]
    assert res.usage.completion_tokens == sum(r.completion_tokens for r in refs)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=IMAGE_MSG, n=3, stream=True,
                                              **SAMPLED))
    assert encoder_counts(server)["encoded"] == before + 2
    texts, finish = _texts(chunks, 3)
    assert texts == [r.text for r in refs] and finish == [r.finish_reason for r in refs]
    text_only = oai.chat.completions.create(model=MODEL, messages=TEXT_MSG, n=2, **SAMPLED)
    assert [c.message.content for c in text_only.choices] == \
        [chat(local, TEXT_MSG, seed=11 + i, max_tokens=10, temperature=1.0).text
         for i in range(2)]
    assert_clean(server, http)


def test_vision_tower_runs_once_for_n_choices(server, oai, http):
    """In process, counted at the vision model itself."""
    if hasattr(server.client, "supervisor"):
        pytest.skip("the vision model lives in the worker process (counted by 'encoded')")
    vision = server.engine.engine.model.vision_model
    calls, real = [], vision.forward
    vision.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        oai.chat.completions.create(model=MODEL, messages=IMAGE_MSG, n=3, **SAMPLED)
    finally:
        del vision.forward
    assert len(calls) == 1
    assert_clean(server, http)


def test_client_gone_mid_stream_and_stop_strings_leak_nothing(server, http):
    body = {"model": MODEL, "messages": IMAGE_MSG, "n": 3, "max_tokens": 60,
            "temperature": 1.0, "seed": 3, "stream": True}
    for hang_up_after in (1, 4, 8):  # the role chunks only; mid-generation
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(hang_up_after):
                    next(lines)
        assert_clean(server, http)
    words = ["the", "a", "w40"]  # some choices stop early: their requests are aborted
    r = http.post("/v1/chat/completions", json={**body, "stream": False, "stop": words})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert_clean(server, http)


def _failing_stream(real, fail_owner: bool, after_first: bool):
    """``client.stream`` with one choice failing: the handle's owner (choice 0) or a sibling;
    before anything is submitted, or after its first delta."""

    async def stream(request):
        owner = request.share_encoder
        if owner != fail_owner or (not owner and request.encoder_kv is None):
            async for delta in real(request):
                yield delta
            return
        if not after_first:
            await asyncio.sleep(0.05)
            raise RequestFailed("injected failure before the prefill", request.rid)
        inner = real(request)
        try:
            async for delta in inner:
                yield delta
                raise RequestFailed("injected failure after the first delta", request.rid)
        finally:
            await inner.aclose()

    return stream


@pytest.mark.parametrize("fail_owner,after_first", [(True, False), (True, True),
                                                    (False, True)],
                         ids=["owner-before-prefill", "owner-after-handle", "sibling"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_completion_and_leaks_nothing(server, http, fail_owner,
                                                                 after_first, stream):
    client = server.client
    client.stream = _failing_stream(type(client).stream.__get__(client), fail_owner,
                                    after_first)
    try:
        body = {"model": MODEL, "messages": IMAGE_MSG, "n": 3, "max_tokens": 40,
                "temperature": 1.0, "seed": 5, "stream": stream}
        r = http.post("/v1/chat/completions", json=body)
        if stream:
            assert r.status_code == 200 and "event: error" in r.text and "injected" in r.text
        else:
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    finally:
        del client.stream
    assert_clean(server, http)
    ok = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
    assert_clean(server, http)


def test_a_handle_in_a_delta_nobody_read_is_released(server, http):
    """The client layer's part: a stream closed while its first delta (the handle) waits on
    the event loop releases the handle (in process: ``AsyncEngine.stream``; worker process:
    ``DataParallelClient``, the handle adopted but never taken)."""
    request, _ = prepare_chat(server.client, IMAGE_MSG, max_tokens=40, temperature=1.0, seed=1)
    request = dataclasses.replace(request, share_encoder=True)

    async def close_unread():
        deltas = server.client.stream(request)
        first = asyncio.ensure_future(deltas.__anext__())
        await asyncio.sleep(0)  # submitted (the task waits for its first delta)
        time.sleep(3.0)  # the loop is blocked: the engine's first delta waits to be put
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert first.cancelled()  # the delta (and its handle) never reached us
        await deltas.aclose()
        for _ in range(600):  # this loop must outlive the deltas still on their way to it
            if server.client.num_inflight == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)

    asyncio.run(close_unread())
    assert_clean(server, http)


def test_siblings_are_submitted_without_the_image(server, oai, http, local):
    """What the client is handed: choice 0 with the image (``share_encoder``), the sibling
    with the handle and no image; with an engine worker process the sibling's message is a
    few KB (the pixels are not pickled again). The answers are the unshared ones."""
    refs = [chat(local, IMAGE_MSG, seed=SAMPLED["seed"] + i, max_tokens=10, temperature=1.0)
            for i in range(2)]
    client, submitted, sizes = server.client, [], {}
    real = type(client).stream.__get__(client)

    def spy(request):
        submitted.append(request)
        return real(request)

    def encoded(request, stream):  # the frames sent to the worker (the last per request)
        frames = sizes[request.rid] = type(client)._encoded(request, stream)
        return frames

    client.stream = spy
    if hasattr(client, "supervisor"):
        client._encoded = encoded
    try:
        before = encoder_counts(server)["encoded"]
        res = oai.chat.completions.create(model=MODEL, messages=IMAGE_MSG, n=2, **SAMPLED)
    finally:
        del client.stream
        client.__dict__.pop("_encoded", None)
    assert [c.message.content for c in res.choices] == [r.text for r in refs]
    assert encoder_counts(server)["encoded"] == before + 1
    owner, sibling = submitted
    assert owner.share_encoder and owner.encoder_input is not None
    assert sibling.encoder_input is None and sibling.encoder_kv is not None
    assert sibling.cross_kv_ranges == owner.cross_kv_ranges  # what the image tokens see
    if sizes:
        owner_bytes, sibling_bytes = (sum(len(f) for f in sizes[r.rid])
                                      for r in (owner, sibling))
        assert sibling_bytes < 10_000 < 100_000 < owner_bytes
    assert_clean(server, http)
