"""Llama-3.2-Vision chat through engine worker processes (``--engine-process``; the same path
as ``--data-parallel-size N``): the API process prepares image requests from the model's facts
alone (config, no weights) and the worker's greedy answers equal the in-process engine's."""

from __future__ import annotations

import httpx
import pytest

from edserve.chat.chat_api import chat, prepare_chat
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.models.mllama.inputs import MllamaFacts
from edserve.runtime import build_engine
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests.models.mllama.chat_tiny import png_data_url, save_chat_model  # noqa: E402

MODEL = "tiny-mllama"
ENGINE = dict(device="cpu", dtype="float32", context_length=128, max_running_requests=4,
              threads=1)


def _messages(url: str | None, text: str) -> list[dict]:
    if url is None:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_chat_through_an_engine_worker_equals_the_in_process_engine(tmp_path):
    folder = save_chat_model(tmp_path / "mllama")
    cases = [_messages(png_data_url(100, 50), "describe the image"),
             _messages(png_data_url(40, 90, seed=3), "and this one?"),
             _messages(None, "what is this")]
    local = build_engine(model=str(folder), **ENGINE)
    expected = [chat(local, m, max_tokens=10) for m in cases]

    client, app = build(EngineConfig(model=str(folder), **ENGINE),
                        ServerConfig(engine_process=True, served_model_name=MODEL))
    assert isinstance(client, DataParallelClient)
    assert isinstance(client.model, MllamaFacts)  # no weights in the API process
    assert client.model.image_token_id == local.model.image_token_id
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           timeout=300) as oai:
            for messages, ref in zip(cases, expected, strict=True):
                res = oai.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=10, temperature=0)
                assert res.choices[0].message.content == ref.text
                assert res.usage.completion_tokens == len(ref.token_ids)
            # a bad image is refused with a 400 by the API process, and the worker serves on
            with httpx.Client(base_url=server.url, timeout=120) as http:
                bad = http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4,
                    "messages": _messages("data:image/png;base64,AAAA", "hi")})
                assert bad.status_code == 400, bad.text
                assert http.get("/health").status_code == 200
            again = oai.chat.completions.create(model=MODEL, messages=cases[2], max_tokens=10,
                                                temperature=0, logprobs=True)
            assert again.choices[0].message.content == expected[2].text
            request, _ = prepare_chat(local, cases[2], max_tokens=10)
            want = local.generate([request])[0].logprobs  # crossed the wire with each token
            got = [e.logprob for e in again.choices[0].logprobs.content]
            assert got == pytest.approx(want, abs=1e-5)
    finally:
        server.stop()
        client.shutdown(5.0)
