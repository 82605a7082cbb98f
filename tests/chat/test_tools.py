"""OpenAI function calling in Llama 3's JSON format: the checked request, the prompt the model
sees, the calls read back from its answer, and forced calls on the tiny byte-level Mllama
(grammar-constrained: the arguments must satisfy the function's parameter schema)."""

from __future__ import annotations

import json

import pytest

from edserve.chat.chat_api import chat
from edserve.chat.errors import ChatFormatError
from edserve.chat.mllama_chat import render_chat
from edserve.chat.tools import PREAMBLE, call_schema, parse_calls, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
H = "<|start_header_id|>{}<|end_header_id|>\n\n"


def test_tool_choice_defaults_and_forms():
    assert parse_tools(None) is None and parse_tools([], "none") is None
    auto = parse_tools([WEATHER, CLOCK])
    assert auto.choice == "auto" and not auto.forced and [f["name"] for f in auto.shown] == \
        ["get_weather", "now"]
    assert parse_tools([WEATHER], "none").shown == ()
    assert parse_tools([WEATHER], "required").forced
    named = parse_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}})
    assert named.choice == "function" and named.name == "now" and named.forced


@pytest.mark.parametrize("tools,choice,param,needle", [
    (None, "auto", "tool_choice", "needs 'tools'"),
    ("x", None, "tools", "must be a list"),
    ([WEATHER] * 129, None, "tools", "at most 128"),
    ([{"type": "code"}], None, "tools", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "name must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools",
     "parameters must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools",
     "description must be a string"),
    ([CLOCK, CLOCK], None, "tools", "twice"),
    ([WEATHER], "sometimes", "tool_choice", "must be none, auto, required"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "'nope', which 'tools' does not list"),
])
def test_bad_tool_fields(tools, choice, param, needle):
    with pytest.raises(ChatFormatError) as info:
        parse_tools(tools, choice)
    assert needle in str(info.value) and info.value.param == param


def test_prompt_lists_the_functions_and_renders_calls_and_results():
    req = parse_tools([WEATHER])
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    text = render_chat(msgs, tools=req.shown).text
    listed = json.dumps(WEATHER, indent=4)
    assert text == ("<|begin_of_text|>" + H.format("system") + "Environment: ipython\n"
                    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                    "<|eot_id|>" + H.format("user") + PREAMBLE + listed + "\n\n"
                    "Weather in Oslo?<|eot_id|>" + H.format("assistant")
                    + '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>'
                    + H.format("ipython") + "-3 C<|eot_id|>" + H.format("assistant"))
    # with an image: no system block; the list goes before the image in the user turn
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}},
                                        {"type": "text", "text": "where?"}]}]
    assert render_chat(img, tools=req.shown).text == (
        "<|begin_of_text|>" + H.format("user") + PREAMBLE + listed + "\n\n<|image|>where?"
        "<|eot_id|>" + H.format("assistant"))
    # tool_choice none: the prompt of a plain chat
    assert render_chat(msgs[:1], tools=parse_tools([WEATHER], "none").shown).text == \
        render_chat(msgs[:1]).text


@pytest.mark.parametrize("call,needle", [
    ({"type": "function"}, "must be {'type': 'function'"),
    ({"type": "function", "function": {"name": "f", "arguments": "{bad"}}, "JSON object"),
    ({"type": "function", "function": {"name": "f", "arguments": "[1]"}}, "JSON object"),
])
def test_bad_history_calls(call, needle):
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ChatFormatError, match="tool_calls") as info:
        render_chat(msgs)
    assert needle in str(info.value)


def test_calls_read_from_answers():
    req = parse_tools([WEATHER, CLOCK])
    one = parse_calls(' {"name": "get_weather", "parameters": {"city": "Paris"}}\n', req)
    assert [(c.name, json.loads(c.arguments)) for c in one] == [("get_weather",
                                                                 {"city": "Paris"})]
    assert one[0].id.startswith("call_") and len(one[0].id) == 29
    two = parse_calls('{"name": "now", "arguments": {}}; {"name": "now", "parameters": {}}',
                      req)
    assert [c.name for c in two] == ["now", "now"] and two[0].id != two[1].id
    for text in ["It is sunny.", '{"name": "nope", "parameters": {}}', '{"name": "now"}',
                 '{"name": "now", "parameters": {}} and more', '{"name": "now", "par', "[1]",
                 ""]:
        assert parse_calls(text, req) is None, text
    assert parse_calls('{"name": "now", "parameters": {}}',
                       parse_tools([WEATHER, CLOCK], "none")) is None


def test_forced_calls_follow_the_function_schema(tmp_path):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from tests.chat.grammar_helpers import NO_WHITESPACE, _build
    from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer
    from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny

    save_hf_tiny(build_hf_tiny(), tmp_path)
    engine = _build(save_byte_chat_tokenizer(tmp_path), 1536)  # a byte a token: long prompts
    msgs = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    res = chat(engine, msgs, max_tokens=80, tools=[WEATHER, CLOCK], tool_choice=named,
               logit_bias=NO_WHITESPACE)
    assert res.finish_reason == "stop" and len(res.tool_calls) == 1  # named: "stop", as OpenAI
    call = res.tool_calls[0]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    jsonschema.validate(json.loads(res.text), call_schema(parse_tools([WEATHER], named)))
    for seed in range(3):  # required: calls of either function, sampled (one or more:
        # tests/chat/test_forced_calls.py)
        res = chat(engine, msgs, max_tokens=160, tools=[WEATHER, CLOCK], tool_choice="required",
                   temperature=1.0, seed=seed, logit_bias=NO_WHITESPACE)
        assert res.finish_reason == "tool_calls" and res.tool_calls
        assert {c.name for c in res.tool_calls} <= {"get_weather", "now"}
    with pytest.raises(ChatFormatError, match="cannot be combined"):
        chat(engine, msgs, tools=[WEATHER], response_format={"type": "json_object"})


def test_forced_schema_keeps_defs_resolvable():
    """Pydantic-style parameters ($defs + #/$defs refs) still compile when the call is forced:
    the definitions move to the root; two functions disagreeing on a name are refused."""
    from edserve.chat.response_format import schema_grammar

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fn = {"type": "function", "function": {"name": "where", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": loc}}}}
    schema = call_schema(parse_tools([fn], "required"))
    assert schema["$defs"] == {"Loc": loc} and "$defs" not in \
        schema["properties"]["parameters"]
    assert isinstance(schema_grammar(schema), str)
    other = {"type": "function", "function": {"name": "there", "parameters": {
        "type": "object", "properties": {"l": {"$ref": "#/$defs/Loc"}},
        "$defs": {"Loc": {"type": "integer"}}}}}
    with pytest.raises(ChatFormatError, match="define \\$defs 'Loc' differently") as info:
        call_schema(parse_tools([fn, other], "required"))
    assert info.value.param == "tools"


def test_odd_answers_are_text_not_calls():
    req = parse_tools([CLOCK])
    deep = '{"name": "now", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    assert parse_calls(deep, req) is None  # nested past Python's recursion limit
    assert parse_calls('{"name": "now", "parameters": {"x": NaN}}', req) is None
