"""OpenAI ``response_format`` -> grammar: what is accepted, and what is refused with a message
naming the field (the server turns these into 400s)."""

from __future__ import annotations

import pytest

from edserve.chat.mllama_chat import ChatFormatError
from edserve.chat.response_format import MAX_SCHEMA_BYTES, response_grammar


def _schema(schema, name="answer", **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


def test_free_text_has_no_grammar():
    assert response_grammar(None) is None
    assert response_grammar({"type": "text"}) is None


def test_json_modes_give_distinct_grammars():
    obj = response_grammar({"type": "json_object"})
    assert isinstance(obj, str) and '"object"' in obj
    g = response_grammar(_schema({"type": "object", "properties": {"a": {"enum": ["x"]}}}))
    assert '"enum"' in g and g != obj
    # no schema (or null): any JSON object, as json_object
    assert response_grammar({"type": "json_schema", "json_schema": {"name": "n"}}) == obj
    assert response_grammar(_schema(None)) == obj
    assert response_grammar(_schema({"type": "string"}, strict=True)) is not None


@pytest.mark.parametrize("value,needle", [
    ("json", "must be an object with a 'type'"),
    ({"kind": "json_object"}, "must be an object with a 'type'"),
    ({"type": "xml"}, "must be one of text, json_object, json_schema; got 'xml'"),
    ({"type": "json_schema"}, "'response_format.json_schema' is required"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "name' must be 1-64"),
    (_schema({}, name="has space"), "name' must be 1-64"),
    (_schema({}, name="x" * 65), "name' must be 1-64"),
    (_schema({}, strict="yes"), "strict' must be a boolean"),
    (_schema([1, 2]), "schema' must be a JSON Schema object"),
    (_schema({"type": "strnig"}), "unsupported JSON schema: Invalid type: strnig"),
    (_schema({"type": "object", "if": {}}), 'Unimplemented keys: ["if"]'),
    (_schema({"not": {"type": "string"}}), 'Unimplemented keys: ["not"]'),
    (_schema({"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable schema"),
    (_schema({"$ref": "http://example.com/s.json"}), "does not fetch"),  # no network access
    (_schema({"enum": ["x" * MAX_SCHEMA_BYTES]}), f"over {MAX_SCHEMA_BYTES} bytes"),
])
def test_bad_values_are_refused_naming_the_field(value, needle):
    with pytest.raises(ChatFormatError, match=None) as info:
        response_grammar(value)
    assert needle in str(info.value) and info.value.param == "response_format"


# ---- vLLM's structured_outputs / guided_* ----------------------------------------------------

from edserve.chat.response_format import structured_grammar  # noqa: E402


@pytest.mark.parametrize("spec", [{"regex": r"\d{3}-[a-z]+"}, {"choice": ["yes", 'say "hi"\n']},
                                  {"grammar": 'start: "a" /[0-9]+/'},
                                  {"json": {"type": "integer"}}, {"json": '{"type": "string"}'},
                                  {"json_object": True, "disable_any_whitespace": True}])
def test_structured_kinds_compile(spec):
    assert isinstance(structured_grammar(spec), str)
    assert structured_grammar(None) is None


@pytest.mark.parametrize("spec,needle", [
    (3, "must be an object"),
    ({}, "needs exactly one of json, regex, choice, grammar, json_object; got 0"),
    ({"regex": "a", "choice": ["b"]}, "got 2"),
    ({"whitespace_pattern": " "}, "does not take 'whitespace_pattern'"),
    ({"regex": "("}, "invalid regex: "),
    ({"regex": ""}, "'regex' must be a non-empty string"),
    ({"choice": []}, "'choice' must be a list of 1 to 256"),
    ({"choice": ["a", 3]}, "'choice' must be a list"),
    ({"grammar": "start: foo"}, 'invalid grammar (Lark): at 1(8): unknown name: "foo"'),
    ({"json": "nope"}, "'json' must be a JSON Schema"),
    ({"json": {"type": "strnig"}}, "unsupported JSON schema: Invalid type: strnig"),
])
def test_bad_structured_outputs_name_the_field(spec, needle):
    with pytest.raises(ChatFormatError) as info:
        structured_grammar(spec, param="guided_x")
    assert needle in str(info.value) and info.value.param == "guided_x"
