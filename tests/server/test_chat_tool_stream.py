"""Tool calls streamed in pieces through a live chat server and the official ``openai``
client: each call's header (id, type, name, empty arguments) comes first, then its arguments
piece by piece; put together they equal the non-streamed answer to the same request (the same
``arguments`` string, the same finish reason), and the streamed log-probabilities equal the
non-streamed ones."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from tests.chat.test_tools import CLOCK, WEATHER  # noqa: E402
from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer  # noqa: E402
from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny  # noqa: E402
from tests.server.server_helpers import chat_server, openai_client  # noqa: E402
from tests.server.test_chat import _idle_integrity  # noqa: E402
from tests.server.test_chat_json import BIAS, ENGINE, MESSAGES, MODEL  # noqa: E402

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool_stream")
    save_hf_tiny(build_hf_tiny(), folder)
    save_byte_chat_tokenizer(folder)
    with chat_server(folder, MODEL, ENGINE) as (srv, _, _):
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server.url) as c:
        yield c


def collect(chunks) -> dict:
    """Per choice: its text, its calls put together from their pieces (checking that a call's
    first delta is its header), the argument deltas per call, log-probs and finish reason."""
    out: dict = {}
    for chunk in chunks:
        for ch in chunk.choices:
            got = out.setdefault(ch.index, {"content": "", "calls": {}, "pieces": {},
                                            "logprobs": [], "finish": None})
            got["content"] += ch.delta.content or ""
            got["logprobs"] += [(e.token, e.logprob) for e in
                                (ch.logprobs.content if ch.logprobs else [])]
            got["finish"] = ch.finish_reason or got["finish"]
            for t in ch.delta.tool_calls or []:
                if t.index not in got["calls"]:
                    assert t.index == len(got["calls"]) and t.type == "function"
                    assert t.id.startswith("call_") and t.function.arguments == ""
                    got["calls"][t.index] = [t.id, t.function.name, ""]
                    got["pieces"][t.index] = 0
                else:
                    assert t.id is None and t.function.name is None and t.function.arguments
                    got["calls"][t.index][2] += t.function.arguments
                    got["pieces"][t.index] += 1
    return out


def _same(streamed: dict, choice) -> None:
    """A streamed choice equals the non-streamed ``choice``."""
    calls = choice.message.tool_calls or []
    assert [(name, args) for _, name, args in streamed["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["finish"] == choice.finish_reason
    if choice.logprobs is not None:
        want = [(e.token, e.logprob) for e in choice.logprobs.content]
        assert [t for t, _ in streamed["logprobs"]] == [t for t, _ in want]
        assert [lp for _, lp in streamed["logprobs"]] == pytest.approx([lp for _, lp in want],
                                                                       abs=1e-4)


def test_a_named_call_streams_in_pieces_equal_to_the_whole_answer(oai, server):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, logit_bias=BIAS,
              tools=[WEATHER, CLOCK], tool_choice=NAMED, logprobs=True, top_logprobs=2)
    whole = oai.chat.completions.create(**kw).choices[0]
    args = whole.message.tool_calls[0].function.arguments
    assert whole.finish_reason == "stop" and json.loads(args)["city"] in ("Paris", "Oslo")
    streamed = collect(oai.chat.completions.create(stream=True, **kw))[0]
    _same(streamed, whole)
    assert streamed["pieces"][0] > 1  # arguments in several deltas, not whole at the end
    with httpx.Client(base_url=server.url, timeout=60) as http:
        _idle_integrity(http)


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_required_calls_and_n_choices(oai, seed):
    """``required``, sampled with a seed, two choices: each streamed choice equals the
    non-streamed one (its own call, ``tool_calls`` finish, log-probs)."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed, n=2,
              logit_bias=BIAS, tools=[WEATHER, CLOCK], tool_choice="required", logprobs=True)
    whole = oai.chat.completions.create(**kw).choices
    streamed = collect(oai.chat.completions.create(stream=True, **kw))
    assert sorted(streamed) == [0, 1]
    for choice in whole:  # the schema's calls are short: none is cut by max_tokens
        _same(streamed[choice.index], choice)
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert streamed[choice.index]["pieces"][0] >= 1
        if choice.message.tool_calls[0].function.name == "get_weather":
            assert streamed[choice.index]["pieces"][0] > 1


@pytest.mark.parametrize("parallel", [True, False])
def test_required_parallel_calls_stream_as_the_whole_answer(oai, parallel):
    """``required`` with parallel calls: seed 0 writes two calls (random weights; the grammar
    lets them go on after a call), streamed as calls 0 and 1, each equal to the non-streamed
    one and valid against its function; ``parallel_tool_calls`` false forces exactly one."""
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=1.0, seed=0,
              logit_bias=BIAS, tools=[WEATHER, CLOCK], tool_choice="required",
              parallel_tool_calls=parallel, logprobs=True)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and len(calls) == (2 if parallel else 1)
    params = {f["function"]["name"]: f["function"].get("parameters", {}) for f in (WEATHER,
                                                                                     CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    streamed = collect(oai.chat.completions.create(stream=True, **kw))[0]
    _same(streamed, whole)


def test_a_call_cut_by_max_tokens_ends_with_what_was_sent(oai):
    """A call the stream has begun cannot be taken back: cut by ``max_tokens`` it ends with the
    header and the arguments so far, finish reason ``length``; the non-streamed answer is the
    text. Every log-probability still arrives."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=38, temperature=0, logit_bias=BIAS,
              tools=[WEATHER, CLOCK], tool_choice=NAMED, logprobs=True)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    text = whole.message.content
    streamed = collect(oai.chat.completions.create(stream=True, **kw))[0]
    (_, name, args), = streamed["calls"].values()
    assert name == "get_weather" and streamed["content"] == "" and args
    assert text.endswith(args) and text.startswith('{"name":"get_weather"')
    assert streamed["finish"] == "length"
    assert [t for t, _ in streamed["logprobs"]] == [e.token for e in whole.logprobs.content]
