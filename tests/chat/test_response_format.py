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
