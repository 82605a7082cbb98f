"""OpenAI's ``response_format`` for chat completions -> the grammar the output must follow.

* absent, or ``{"type": "text"}``: free text (no grammar);
* ``{"type": "json_object"}`` (JSON mode): one JSON object;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
  (structured outputs): one JSON value valid against ``schema`` (a JSON object schema when
  ``schema`` is absent). The schema is enforced whatever ``strict`` says; a keyword llguidance
  does not implement is refused, not ignored.

JSON may carry whitespace between tokens, as vLLM's default (``whitespace_flexible``; the
server's ``--no-json-whitespace`` makes it compact); the output ends right after the value
(only the chat's stop tokens may follow it). Malformed values raise
:class:`~edserve.chat.errors.ChatFormatError` naming ``response_format`` (a 400 from the
server). The grammar is llguidance's text, compiled per request by
:class:`~edserve.chat.grammar_filter.GrammarFilter`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from edserve.chat.errors import ChatFormatError
from edserve.chat.grammar_filter import llguidance

FORMATS = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
MAX_SCHEMA_BYTES = 64 * 1024  # a schema this large is refused (compile time grows with it)


def _fail(message: str) -> ChatFormatError:
    return ChatFormatError(message, "response_format")


def schema_grammar(schema: dict, whitespace: bool = True, param: str = "response_format",
                   separator: str | None = None) -> str:
    """llguidance's grammar for one JSON value valid against ``schema`` (ChatFormatError naming
    ``param`` when llguidance cannot use the schema); ``whitespace`` False: compact JSON (no
    whitespace between tokens). With ``separator``: one or more such values, ``separator``
    between them (a Lark grammar, ``start: value (separator value)*``, whose ``value`` is the
    schema embedded with llguidance's ``%json``; no bound but the output's ``max_tokens``)."""
    llg = llguidance()
    options = {"whitespace_flexible": whitespace}
    try:
        one = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        grammar = one if separator is None else llg.LLMatcher.grammar_from_lark(
            f"start: value ({json.dumps(separator)} value)*\n"
            f"value: %json {json.dumps({**schema, 'x-guidance': options})}\n")
    except (ValueError, RecursionError) as exc:
        raise ChatFormatError(f"invalid JSON schema: {str(exc)[:200]}", param) from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error and grammar is not one:  # the schema's own words, without the Lark around them
        error = llg.LLMatcher.validate_grammar(one) or error
    if error:
        raise ChatFormatError(f"unsupported JSON schema: {error}", param)
    return grammar


def response_grammar(response_format: Any, whitespace: bool = True) -> str | None:
    """The grammar ``response_format`` asks for; None for free text (``whitespace``: as
    :func:`schema_grammar`)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _fail("'response_format' must be an object with a 'type'")
    kind = response_format["type"]
    if kind not in FORMATS:
        raise _fail(f"'response_format.type' must be one of {', '.join(FORMATS)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar({"type": "object"}, whitespace)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _fail("'response_format.json_schema' is required for type json_schema: an "
                    "object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or "
                    f"'-'; got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _fail("'response_format.json_schema.strict' must be a boolean")
    schema = spec.get("schema")
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise _fail("'response_format.json_schema.schema' must be a JSON Schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise _fail(f"'response_format.json_schema.schema' is over {MAX_SCHEMA_BYTES} bytes")
    return schema_grammar(schema, whitespace)


# vLLM's ``structured_outputs`` (and its older ``guided_*`` fields): one constraint each.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace",)
MAX_CHOICES = 256


def structured_grammar(spec: Any, whitespace: bool = True,
                       param: str = "structured_outputs") -> str | None:
    """The grammar of vLLM's ``structured_outputs`` object: exactly one of ``json`` (a JSON
    Schema, as an object or its text), ``regex`` (the whole answer matches it), ``choice``
    (the answer is one of these strings), ``grammar`` (a Lark grammar, llguidance's dialect),
    ``json_object: true``; ``disable_any_whitespace: true`` makes JSON compact. None for
    None. ChatFormatError naming ``param`` otherwise."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ChatFormatError(f"'{param}' must be an object", param)
    unknown = sorted(set(spec) - set(STRUCTURED_KINDS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise ChatFormatError(f"'{param}' does not take {unknown[0]!r:.40}; it takes one of "
                              f"{', '.join(STRUCTURED_KINDS)}", param)
    kinds = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ChatFormatError(f"'{param}' needs exactly one of {', '.join(STRUCTURED_KINDS)}; "
                              f"got {len(kinds)}", param)
    kind, value = kinds[0], spec[kinds[0]]
    if spec.get("disable_any_whitespace"):
        whitespace = False
    try:
        return _STRUCTURED[kind](value, whitespace)
    except ChatFormatError as exc:  # the kinds' checks name no field: name ``param``
        raise ChatFormatError(str(exc), param) from None


def _json(value: Any, whitespace: bool) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise _fail("'json' must be a JSON Schema (an object or its JSON text)") from None
    if not isinstance(value, dict):
        raise _fail("'json' must be a JSON Schema (an object or its JSON text)")
    return schema_grammar(value, whitespace)


def _checked(grammar: str, what: str) -> str:
    error = llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise _fail(f"invalid {what}: {' '.join(error.split())[:240]}")
    return grammar


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_SCHEMA_BYTES:
        raise _fail(f"'{what}' must be a non-empty string of at most {MAX_SCHEMA_BYTES} "
                    "characters")
    return value


def _regex(value: Any, whitespace: bool) -> str:
    matcher = llguidance().LLMatcher
    return _checked(matcher.grammar_from_regex(_text(value, "regex")), "regex")


def _choice(value: Any, whitespace: bool) -> str:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in value):
        raise _fail(f"'choice' must be a list of 1 to {MAX_CHOICES} non-empty strings")
    lark = "start: " + " | ".join(json.dumps(c) for c in value)
    return _checked(llguidance().LLMatcher.grammar_from_lark(_text(lark, "choice")), "choice")


def _lark(value: Any, whitespace: bool) -> str:
    matcher = llguidance().LLMatcher
    return _checked(matcher.grammar_from_lark(_text(value, "grammar")), "grammar (Lark)")


_STRUCTURED = {"json": _json, "regex": _regex, "choice": _choice, "grammar": _lark,
               "json_object": lambda _, ws: schema_grammar({"type": "object"}, ws)}
