"""A forced ``tool_choice``'s grammar, driven token by token by an independent llguidance
matcher over the byte-level test tokenizer: ``required`` with parallel calls takes one or more
calls of the listed functions separated by ``"; "``, each valid against its function's
schema (``$defs`` references included); without parallel calls, or with a named function,
exactly one. Then the same through the tiny random Mllama: every call it writes parses and
validates, and it does write two (sampled; random weights rarely choose to go on)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edserve.chat.errors import ChatFormatError
from edserve.chat.response_format import schema_grammar
from edserve.chat.tools import call_schema, parse_tools
from tests.chat.test_tools import CLOCK, WEATHER

llguidance = pytest.importorskip("llguidance")

from tests.chat.grammar_helpers import _allowed, _oracle  # noqa: E402
from tests.models.mllama.chat_tiny import STOP_IDS, save_byte_chat_tokenizer  # noqa: E402

LOC = {"type": "object", "additionalProperties": False, "required": ["city"],
       "properties": {"city": {"type": "string", "maxLength": 8}}}
WHERE = {"type": "function", "function": {"name": "where", "parameters": {  # pydantic-style
    "type": "object", "additionalProperties": False, "required": ["to"],
    "properties": {"to": {"$ref": "#/$defs/Loc"}, "via": {"type": "array", "maxItems": 2,
                                                          "items": {"$ref": "#/$defs/Loc"}}},
    "$defs": {"Loc": LOC}}}}
TOOLS = [WEATHER, CLOCK, WHERE]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OSLO = {"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}
NOW = {"name": "now", "parameters": {}}
TRIP = {"name": "where", "parameters": {"to": {"city": "Bergen"}, "via": [{"city": "Voss"}]}}
BAD = [{"name": "get_weather", "parameters": {"city": "Rome"}},  # not in the enum
       {"name": "get_weather", "parameters": {"days": 3}},  # city is required
       {"name": "now", "parameters": {"x": 1}},  # no parameters: an empty object
       {"name": "where", "parameters": {"to": {"town": "Bergen"}}},  # not a Loc ($defs)
       {"name": "nope", "parameters": {}}]  # not a listed function


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer
    folder = save_byte_chat_tokenizer(tmp_path_factory.mktemp("bytes"))
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def text(*calls: dict, compact: bool = True, sep: str = "; ") -> str:
    dump = (lambda c: json.dumps(c, separators=(",", ":"))) if compact else json.dumps
    return sep.join(dump(c) for c in calls)


def walk(tok, grammar: str, answer: str) -> tuple[bool, int]:
    """Force ``answer``'s tokens one at a time through an independent matcher, each checked
    against its mask first; then the end (a stop token) must be allowed. (accepted, tokens
    taken)."""
    matcher = _oracle(SimpleNamespace(tokenizer=tok), grammar)
    ids = tok.encode(answer, add_special_tokens=False).ids
    for k, t in enumerate(ids):
        if not _allowed(matcher)[t]:
            return False, k
        assert matcher.consume_token(t), matcher.get_error()
    allowed = _allowed(matcher)
    return bool(all(allowed[s] for s in STOP_IDS) and matcher.is_accepting()), len(ids)


def grammar(choice, parallel: bool = True, whitespace: bool = False) -> str:
    req = parse_tools(TOOLS, choice, parallel)
    return schema_grammar(call_schema(req), whitespace, "tools", req.separator)


@pytest.mark.parametrize("whitespace", [False, True])
def test_required_takes_one_or_more_calls_of_listed_functions(tok, whitespace):
    g = grammar("required", whitespace=whitespace)
    compact = not whitespace
    for calls in [(OSLO,), (NOW, OSLO), (OSLO, OSLO, TRIP, NOW), (TRIP, TRIP)]:
        assert walk(tok, g, text(*calls, compact=compact)) == (True, len(tok.encode(
            text(*calls, compact=compact), add_special_tokens=False).ids)), calls
    for bad in BAD:  # a bad call, first or after good ones, is refused where it goes wrong
        for calls in [(bad,), (OSLO, bad), (NOW, TRIP, bad)]:
            ok, taken = walk(tok, g, text(*calls, compact=compact))
            before = tok.encode(text(*calls[:-1], compact=compact), add_special_tokens=False)
            assert not ok and taken >= len(before.ids), calls
    for answer in [text(OSLO, NOW, sep=";"), text(OSLO, NOW, sep=" ; "), text(OSLO) + "; ",
                   text(OSLO) + ";", "", "It is sunny.", text(OSLO) + " "]:
        assert not walk(tok, g, answer)[0], answer  # only "; " between calls, nothing after


@pytest.mark.parametrize("whitespace", [False, True])
def test_one_call_without_parallel_calls_or_with_a_named_function(tok, whitespace):
    compact = not whitespace
    for choice, first in [("required", NOW), (NAMED, OSLO)]:
        for parallel in ([False] if choice == "required" else [True, False]):
            g = grammar(choice, parallel, whitespace)
            one = text(first, compact=compact)
            assert walk(tok, g, one)[0]
            matcher = _oracle(SimpleNamespace(tokenizer=tok), g)
            assert matcher.consume_tokens(tok.encode(one, add_special_tokens=False).ids)
            allowed = _allowed(matcher)  # after the call: only the end
            assert sorted(allowed.nonzero()[0]) == sorted(STOP_IDS), (choice, parallel)
            ok, taken = walk(tok, g, text(first, first, compact=compact))
            assert not ok and taken == len(tok.encode(one, add_special_tokens=False).ids)
    assert not walk(tok, grammar(NAMED), text(NOW))[0]  # named: that function only


def test_defs_stay_resolvable_and_errors_name_tools():
    """The hoisted ``$defs`` resolve inside the embedded schema; a schema llguidance cannot
    use is reported in the schema's own words (not the Lark grammar around it), naming
    ``tools``."""
    req = parse_tools([WHERE], "required")
    assert call_schema(req)["$defs"] == {"Loc": LOC} and req.separator == "; "
    assert schema_grammar(call_schema(req), True, "tools", req.separator) != \
        schema_grammar(call_schema(req), True, "tools")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    with pytest.raises(ChatFormatError) as info:
        grammar_of = parse_tools([odd], "required")
        schema_grammar(call_schema(grammar_of), True, "tools", grammar_of.separator)
    assert info.value.param == "tools" and "not" in str(info.value)
    assert "%json" not in str(info.value) and len(str(info.value)) < 200
    with pytest.raises(ChatFormatError, match="'parallel_tool_calls' must be a boolean"):
        parse_tools(TOOLS, "required", "yes")


def test_the_engine_writes_valid_calls(tmp_path):
    """The tiny random Mllama, ``required``, sampled: every answer is calls (finish reason
    ``tool_calls``), each valid against its function; seed 0 writes two. Without parallel
    calls the same seeds write one each."""
    jsonschema = pytest.importorskip("jsonschema")
    from edserve.chat.chat_api import chat
    from tests.chat.grammar_helpers import NO_WHITESPACE, _build
    from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny

    save_hf_tiny(build_hf_tiny(), tmp_path)
    engine = _build(save_byte_chat_tokenizer(tmp_path), 1536)  # a byte a token: long prompts
    tools = [WEATHER, CLOCK]  # (with WHERE the byte-a-token prompt outgrows the context)
    params = {f["function"]["name"]: f["function"].get("parameters", {}) for f in tools}
    msgs = [{"role": "user", "content": "Weather?"}]
    counts = {}
    for parallel in (True, False):
        for seed in range(3):
            res = chat(engine, msgs, max_tokens=160, tools=tools, tool_choice="required",
                       parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                       logit_bias=NO_WHITESPACE)
            assert res.finish_reason == "tool_calls" and res.tool_calls, res.text
            for call in res.tool_calls:
                jsonschema.validate(json.loads(call.arguments), params[call.name])
            assert res.text == "; ".join(json.dumps(
                {"name": c.name, "parameters": json.loads(c.arguments)}, separators=(",", ":"))
                for c in res.tool_calls)  # the calls are the whole answer
            counts[parallel, seed] = len(res.tool_calls)
    assert max(counts[True, s] for s in range(3)) > 1, counts
    assert all(counts[False, s] == 1 for s in range(3)), counts
