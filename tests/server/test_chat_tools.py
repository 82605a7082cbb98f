"""Text or tool calls, decided as a streamed answer arrives (``CallCollector``)."""

from __future__ import annotations

import json

from edserve.chat.tools import answer_calls, parse_tools
from edserve.server.chat_tools import CallCollector, calls_delta
from tests.chat.test_tools import CLOCK, WEATHER

CALL = '{"name": "now", "parameters": {}}'


def _run(tools, pieces, parallel=True):
    c = CallCollector(tools, parallel)
    sent = [c.feed(p, [{"t": p}]) for p in pieces]
    return sent, c.finish()


def test_without_tools_everything_passes_through():
    sent, (text, entries, calls) = _run(None, ["{", "x"])
    assert sent == [("{", [{"t": "{"}]), ("x", [{"t": "x"}])] and (text, entries, calls) == \
        ("", None, None)
    sent, _ = _run(parse_tools([WEATHER], "none"), ["{"])
    assert sent == [("{", [{"t": "{"}])]


def test_auto_streams_text_from_its_first_character():
    sent, (text, entries, calls) = _run(parse_tools([WEATHER]), ["  ", "Hi", " there"])
    assert sent == [("", None), ("  Hi", [{"t": "  "}, {"t": "Hi"}]), (" there", [{"t": " there"}])]
    assert (text, entries, calls) == ("", None, None)


def test_auto_holds_what_may_be_a_call():
    tools = parse_tools([WEATHER, CLOCK])
    sent, (text, entries, calls) = _run(tools, ['{"name": "now", ', '"parameters": {}}'])
    assert sent == [("", None), ("", None)] and text == ""
    assert [c.name for c in calls] == ["now"] and entries == [{"t": '{"name": "now", '},
                                                              {"t": '"parameters": {}}'}]
    sent, (text, entries, calls) = _run(tools, ["{not a call}"])  # released as text at the end
    assert text == "{not a call}" and calls is None and entries == [{"t": "{not a call}"}]


def test_forced_and_parallel():
    tools = parse_tools([CLOCK], "required")
    sent, (_, _, calls) = _run(tools, [CALL + "; ", CALL])
    assert sent == [("", None), ("", None)] and len(calls) == 2
    assert len(_run(tools, [CALL + "; " + CALL], parallel=False)[1][2]) == 1
    assert len(answer_calls(CALL + ";" + CALL, tools, parallel=False)) == 1
    assert answer_calls(CALL, parse_tools([CLOCK], "none")) is None
    delta = calls_delta(calls)
    assert [d["index"] for d in delta["tool_calls"]] == [0, 1]
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {}
