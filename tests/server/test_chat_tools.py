"""Text or tool calls in pieces, decided as a streamed answer arrives (``CallCollector``): fed
any split of an answer (a character at a time, random chunks), a stream sends exactly what
the whole answer gives (``answer_calls``): the same text, or each call's header first and
argument pieces that concatenate to its non-streamed ``arguments``; log-probability entries
in order, each once."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from edserve.chat.tools import answer_calls, parse_tools
from edserve.server.chat_tools import CallCollector
from tests.chat.test_tools import CLOCK, WEATHER

CALL = '{"name": "now", "parameters": {}}'
OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'
AUTO = parse_tools([WEATHER, CLOCK])
CALLS = [CALL, OSLO, " \n" + OSLO + "\n", CALL + "; " + OSLO, OSLO + ";" + CALL + ";",
         OSLO + OSLO, '{"parameters": {"city": "Paris"}, "name": "get_weather"}',
         '{"name":"get_weather","arguments":{\n  "city": "Oslo",\n  "x": [1, {"}": "\\"{"}]\n}}',
         '{"name": "now", "parameters": {}, "extra": [1, "two"], "n": -1.5e3, "z": null}']
TEXTS = ["It is sunny.", "  Hi {there}", '{"answer": 42}', '{"name": "nope", "parameters": {}}',
         '{"name": "now"}', '{"name": "now", "parameters": []}', "[1, 2]", "", "   ",
         '{"name": "nope", "parameters": {"x": 1}, "name": "now"}']
CUT = ['{"name": "get_weather", "parameters": {"city": "Os',  # cut by max_tokens
       CALL + " and that is the time", CALL + '; {"name": "nope", "parameters": {}}',
       '{"name": "now", "parameters": {"x": NaN}}', '{"name": "now", "parameters": {"a" 1}}',
       '{"name": "now", "parameters": {}, "arguments": {}}']


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """The whole text, a character at a time, and random chunkings."""
    out = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def stream(tools, pieces, parallel=True) -> dict:
    """Everything a stream sent, put together, with its checks of shape and order."""
    c = CallCollector(dataclasses.replace(tools, parallel=parallel))
    sent = [d for p in pieces for d in c.feed(p, [p])]
    end = c.finish()
    sent += end.deltas
    content, calls = "", {}
    for delta, _ in sent:
        assert set(delta) <= {"content", "tool_calls"} and len(delta) == 1, delta
        content += delta.get("content", "")
        for t in delta.get("tool_calls", []):
            k = t["index"]
            if k not in calls:  # the header: first, with id, type and name, arguments ""
                assert k == len(calls) and t["function"] == {
                    "name": t["function"]["name"], "arguments": ""} and t["type"] == "function"
                calls[k] = {"id": t["id"], "name": t["function"]["name"], "args": "",
                            "pieces": 0}
            else:
                assert t == {"index": k, "function": {"arguments": t["function"]["arguments"]}}
                assert t["function"]["arguments"]
                calls[k]["args"] += t["function"]["arguments"]
                calls[k]["pieces"] += 1
    assert not (content and calls)
    entries = [e for _, es in sent for e in es or []] + (end.entries or [])
    assert "".join(entries) == "".join(pieces)  # every piece's entries once, in order
    return {"content": content, "calls": calls, "made": end.calls}


@pytest.mark.parametrize("text", CALLS)
@pytest.mark.parametrize("parallel", [True, False])
def test_calls_stream_in_pieces_that_add_up_to_the_whole_answer(text, parallel):
    want = answer_calls(text, dataclasses.replace(AUTO, parallel=parallel))
    assert want, text
    for pieces in splits(text, random.Random(text)):
        got = stream(AUTO, pieces, parallel)
        assert got["content"] == ""
        assert [(c["name"], c["args"]) for c in got["calls"].values()] == \
            [(c.name, c.arguments) for c in want]
        assert [(c.id, c.name, c.arguments) for c in got["made"]] == \
            [(c["id"], c["name"], c["args"]) for c in got["calls"].values()]
        named_first = text.lstrip().find('"name"') < text.lstrip().find("{", 1)
        if len(pieces) == len(text) and named_first:  # a piece per character of arguments
            assert [c["pieces"] for c in got["calls"].values()] == \
                [len(c.arguments) for c in want]


@pytest.mark.parametrize("text", TEXTS)
def test_answers_that_are_no_calls_come_out_as_text(text):
    assert answer_calls(text, AUTO) is None
    for pieces in splits(text, random.Random(text)) if text else [[]]:
        assert stream(AUTO, pieces) == {"content": text, "calls": {}, "made": None}


def test_text_is_released_once_it_cannot_be_calls():
    c = CallCollector(AUTO)
    assert c.feed("  ", ["a"]) == [] and c.feed("Hi", ["b"]) == [({"content": "  Hi"}, ["a", "b"])]
    assert c.feed(" there", ["c"]) == [({"content": " there"}, ["c"])]
    c = CallCollector(AUTO)
    assert c.feed('{"name": "no', None) == []
    assert c.feed('pe", "par', None) == [({"content": '{"name": "nope", "par'}, None)]
    assert c.finish() == ([], None, None)


def test_header_when_the_name_is_known_and_its_arguments_begin():
    c = CallCollector(AUTO)
    assert c.feed('{"name": "get_weather"', ["a"]) == []
    assert c.feed(', "parameters": ', ["b"]) == []
    (header, entries), (piece, none) = c.feed('{"ci', ["c"])
    assert entries == ["a", "b", "c"] and none is None  # held entries ride on the first delta
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert piece == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert c.feed('ty": "Paris"}', ["d"])[0][0]["tool_calls"][0]["function"] == \
        {"arguments": 'ty": "Paris"}'}
    assert c.feed("}", ["e"]) == []  # the call's own "}" is no argument: its entry waits
    end = c.finish()
    assert end.deltas == [] and end.entries == ["e"] and end.calls[0].arguments == \
        '{"city": "Paris"}'


@pytest.mark.parametrize("text", CUT)
def test_a_call_that_then_fails_ends_with_what_was_sent(text):
    """The stream cannot take back a call it has begun: it sends nothing more of the answer and
    has no calls at the end (the finish reason is the engine's); the non-streamed answer is
    the text. What was sent does not depend on the split."""
    assert answer_calls(text, AUTO) is None
    results = [stream(AUTO, p) for p in splits(text, random.Random(text))]
    first = results[0]
    assert first["content"] == "" and first["made"] is None and first["calls"][0]["name"]
    assert all({**r, "calls": [(c["name"], c["args"]) for c in r["calls"].values()]}
               == {**first, "calls": [(c["name"], c["args"]) for c in first["calls"].values()]}
               for r in results)
    assert first["calls"][0]["args"] == text[text.index("{", 1):][:len(first["calls"][0]["args"])]


def test_without_functions_and_forced():
    for tools in (None, parse_tools([WEATHER], "none")):
        c = CallCollector(tools)
        assert c.feed("{", ["{"]) == [({"content": "{"}, ["{"])] and c.finish() == ([], None, None)
    forced = parse_tools([CLOCK], "required")
    got = stream(forced, list(CALL + "; " + CALL))
    assert [c["name"] for c in got["calls"].values()] == ["now", "now"] and got["made"]
    got = stream(forced, list(CALL + "; " + CALL), parallel=False)
    assert len(got["calls"]) == len(got["made"]) == 1
    assert json.loads(got["made"][0].arguments) == {}
