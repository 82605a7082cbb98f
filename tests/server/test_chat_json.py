"""``response_format`` (JSON mode and structured outputs) and ``tools`` on a live chat server,
in process and through an engine worker process (the grammar travels as its text; the worker
compiles it): the official ``openai`` client gets JSON valid against its schema and tool calls
whose arguments satisfy the function's parameters, equal to the Python API's, with and without
streaming (``test_chat_tool_stream`` checks the streamed pieces); bad fields are 400s naming
them; the KV cache is whole after."""

from __future__ import annotations

import json

import httpx
import pytest

from edserve.chat.chat_api import chat
from edserve.runtime import build_engine

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.chat.grammar_helpers import AS_SCHEMA, NO_WHITESPACE, SCHEMA  # noqa: E402
from tests.chat.test_tools import CLOCK, WEATHER  # noqa: E402
from tests.models.mllama.chat_tiny import png_data_url, save_byte_chat_tokenizer  # noqa: E402
from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny  # noqa: E402
from tests.server.server_helpers import chat_server, openai_client  # noqa: E402
from tests.server.test_chat import _idle_integrity  # noqa: E402

MODEL = "tiny-json"
ENGINE = dict(device="cpu", dtype="float32", context_length=1536, max_running_requests=4,
              threads=1)  # a byte a token: the function list alone is ~600 tokens
BIAS = {str(k): v for k, v in NO_WHITESPACE.items()}
MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": png_data_url(80, 40)}},
    {"type": "text", "text": "a pet as json"}]}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json_server")
    save_hf_tiny(build_hf_tiny(), folder)
    return save_byte_chat_tokenizer(folder)


@pytest.fixture(scope="module")
def local(folder):
    return build_engine(model=str(folder), **ENGINE)


@pytest.fixture(scope="module", params=["in_process", "engine_process"])
def server(request, folder):
    with chat_server(folder, MODEL, ENGINE, request.param == "engine_process") as (srv, _, _):
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server.url) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def test_structured_output_is_valid_and_equals_the_python_api(oai, http, local):
    ref = chat(local, MESSAGES, max_tokens=60, logit_bias=NO_WHITESPACE,
               response_format=AS_SCHEMA)
    jsonschema.validate(json.loads(ref.text), SCHEMA)
    res = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                      temperature=0, logit_bias=BIAS, response_format=AS_SCHEMA,
                                      logprobs=True, top_logprobs=5)
    choice = res.choices[0]
    assert choice.message.content == ref.text and choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert len(entries) == res.usage.completion_tokens == ref.completion_tokens
    # tokens the grammar ruled out (-inf) are no alternatives: every value is a finite float
    assert all(len(e.top_logprobs) <= 5 for e in entries)
    assert all(a.logprob > -1e30 for e in entries for a in e.top_logprobs)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, logit_bias=BIAS,
        response_format=AS_SCHEMA, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    _idle_integrity(http)


def test_json_mode_and_concurrent_rows(oai, http, local):
    """Sampled JSON-mode rows beside free rows: each grammar row's text is an object when it
    finishes, and the free rows equal their solo answers."""
    free = chat(local, MESSAGES, max_tokens=8)
    bodies = [dict(response_format={"type": "json_object"}, temperature=1.0, seed=s,
                   logit_bias=BIAS, max_tokens=40) for s in range(3)] + [dict(max_tokens=8)] * 2
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(lambda kw: oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, **{"temperature": 0, **kw}), bodies))
    for out in outs[:3]:
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
        else:  # cut by max_tokens: still a prefix the grammar allowed
            assert out.choices[0].message.content.startswith("{")
    assert [o.choices[0].message.content for o in outs[3:]] == [free.text] * 2
    _idle_integrity(http)


@pytest.mark.parametrize("value,needle", [
    ({"type": "xml"}, "must be one of text, json_object, json_schema"),
    ({"type": "json_schema"}, "'response_format.json_schema' is required"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}},
     'Unimplemented keys: ["not"]'),
    ("json", "must be an object"),
])
def test_bad_response_format_is_400_naming_the_field(http, value, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                "response_format": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"], err
    assert http.get("/health").status_code == 200


def test_n_choices_each_equal_their_python_api_answer(oai, local):
    """n=3 seeded JSON-mode sampling: choice i is the Python API's answer with seed + i (its
    own grammar state), streamed or not; the prompt is counted once in usage."""
    kw = dict(max_tokens=24, temperature=1.0, response_format=AS_SCHEMA)
    refs = [chat(local, MESSAGES, seed=5 + i, logit_bias=NO_WHITESPACE, **kw)
            for i in range(3)]
    res = oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, seed=5,
                                      logit_bias=BIAS, **kw)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.message.content for c in res.choices] == [r.text for r in refs]
    assert res.usage.prompt_tokens == refs[0].prompt_tokens
    assert res.usage.completion_tokens == sum(r.completion_tokens for r in refs)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, seed=5, logit_bias=BIAS, stream=True,
        stream_options={"include_usage": True}, **kw))
    texts, finish = ["", "", ""], [None] * 3
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert texts == [r.text for r in refs] and finish == [r.finish_reason for r in refs]
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    greedy = oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=6,
                                         temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_forced_tool_call_streamed_and_not_equals_the_python_api(oai, http, local):
    ref = chat(local, MESSAGES, max_tokens=80, tools=[WEATHER, CLOCK], tool_choice=NAMED,
               logit_bias=NO_WHITESPACE)
    want = [(c.name, json.loads(c.arguments)) for c in ref.tool_calls]
    assert ref.finish_reason == "stop" and want[0][0] == "get_weather"  # named: as OpenAI
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, logit_bias=BIAS,
              tools=[WEATHER, CLOCK], tool_choice=NAMED)
    res = oai.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert _calls(choice.message) == want and choice.message.tool_calls[0].id.startswith("call_")
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # a header, then the arguments in pieces
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert {t.index for t in streamed} == {0} and streamed[0].function.name == want[0][0]
    assert json.loads("".join(t.function.arguments for t in streamed)) == want[0][1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    from tests.server.openapi_check import check_response  # tool calls fit the served schema
    doc, path = http.get("/openapi.json").json(), "/v1/chat/completions"
    body = {**kw, "tools": [WEATHER, CLOCK], "logit_bias": BIAS}
    out = check_response(doc, path, "post", http.post(path, json=body))
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    events = check_response(doc, path, "post", http.post(path, json={**body, "stream": True}))
    assert any(e["choices"] and e["choices"][0]["delta"].get("tool_calls") for e in events)
    _idle_integrity(http)


def test_auto_tools_and_a_tool_result_turn(oai, http, local):
    """auto: whatever the (random) model answers, server and Python API read it the same way;
    a conversation carrying a call and its result is accepted."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    for messages in (MESSAGES, history):
        ref = chat(local, messages, max_tokens=12, tools=[WEATHER, CLOCK])
        res = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0, tools=[WEATHER, CLOCK])
        msg = res.choices[0].message
        if ref.tool_calls:
            assert _calls(msg) == [(c.name, json.loads(c.arguments)) for c in ref.tool_calls]
        else:
            assert msg.content == ref.text and not msg.tool_calls
        assert res.choices[0].finish_reason == ref.finish_reason
    _idle_integrity(http)


@pytest.mark.parametrize("fields,param,needle", [
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools", "name must be"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice", "which 'tools' does not list"),
    (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format",
     "cannot be combined"),
    (dict(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls", "boolean"),
    (dict(functions=[WEATHER["function"]]), "functions", "not supported"),
    (dict(chat_template_kwargs={"x": 1}), "chat_template_kwargs", "not supported"),
    (dict(include_stop_str_in_output=True), "include_stop_str_in_output", "not supported"),
    (dict(guided_json="[" * 100000), "guided_json", "must be a JSON Schema"),  # was a 500
    (dict(messages=MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": "[" * 100000}}]}]),
     "messages[1].tool_calls[0]", "JSON object"),  # was a 500 (RecursionError)
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}}}}], tool_choice="required"),
     "tools", "references into $defs only"),
])
def test_bad_tool_fields_are_400(http, fields, param, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"choice": ["cat", "dog", "red fox"]}},
     lambda t: t in ("cat", "dog", "red fox")),
    ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
    ({"guided_regex": r"[0-9]{3}-[a-c]{2}"},
     lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and set(t[4:]) <= set("abc")),
    ({"structured_outputs": {"grammar": 'start: "id=" /[0-9]{2}/'}},
     lambda t: t.startswith("id=") and t[3:].isdigit() and len(t) == 5),
    ({"guided_json": {"type": "object", "required": ["ok"], "additionalProperties": False,
                      "properties": {"ok": {"type": "boolean"}}},
      "structured_outputs": None},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_vllm_structured_outputs(oai, http, local, extra, check):
    """vLLM's fields through the openai client's extra_body: each answer matches its
    constraint and equals the Python API's."""
    spec = extra.get("structured_outputs") or {
        {"guided_choice": "choice", "guided_regex": "regex",
         "guided_json": "json"}[k]: v for k, v in extra.items() if k.startswith("guided")}
    ref = chat(local, MESSAGES, max_tokens=40, structured_outputs=spec,
               logit_bias=NO_WHITESPACE)
    res = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                      temperature=0, logit_bias=BIAS, extra_body=extra)
    text = res.choices[0].message.content
    assert text == ref.text and res.choices[0].finish_reason == "stop" and check(text), text


@pytest.mark.parametrize("fields,param,needle", [
    (dict(guided_regex="("), "guided_regex", "invalid regex"),
    (dict(guided_choice=[]), "guided_choice", "'choice' must be a list"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     "exactly one of"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "give one of"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "structured_outputs",
     "not both"),
    (dict(guided_regex="a", tools=[WEATHER]), "response_format", "cannot be combined"),
    (dict(top_k=5), "top_k", "not supported"),
    (dict(repetition_penalty=1.2), "repetition_penalty", "not supported"),
    (dict(min_p=0.1), "min_p", "not supported"),
    (dict(guided_whitespace_pattern=" "), "guided_whitespace_pattern", "not supported"),
])
def test_bad_structured_and_unimplemented_extensions_are_400(http, fields, param, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_extensions_at_their_no_op_values_are_accepted(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "top_k": -1, "min_p": 0,
        "repetition_penalty": 1.0, "ignore_eos": False, "guided_decoding_backend": "guidance"})
    assert r.status_code == 200, r.text
