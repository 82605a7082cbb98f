"""OpenAI function calling (``tools`` / ``tool_choice``) in Llama 3's JSON tool-call format.

Llama 3.x Instruct models call a function by answering with one JSON object
``{"name": <function>, "parameters": {<argument>: <value>, ...}}`` (several calls separated by
``;``); they are shown the functions at the start of the first user message, after a fixed
instruction, and the system block (when there are no images) starts with
``Environment: ipython``. A tool's result comes back as an ``ipython`` turn. That is the
prompt :func:`~edserve.chat.mllama_chat.render_chat` writes from a :class:`ToolRequest`.

``tool_choice``:

* ``"none"``: the functions are left out of the prompt; the answer is text;
* ``"auto"`` (the default with tools): the model decides; an answer that parses as calls of the
  listed functions becomes ``tool_calls``, anything else stays text (:func:`parse_calls`;
  a call's ``arguments`` is the model's own JSON text of them, verbatim, so that a stream can
  send it in pieces as it is written: :mod:`edserve.chat.call_scan`);
* ``"required"``: the answer is forced (grammar-constrained decoding) to calls of the listed
  functions, each valid against :func:`call_schema` (a listed name, arguments valid against
  that function's ``parameters`` schema): one or more, separated by ``"; "``
  (:data:`CALL_SEPARATOR`), when ``parallel_tool_calls`` is true (OpenAI's default), exactly
  one when it is false: as vLLM, whose ``required`` grammar is a JSON array of calls with
  ``minItems`` 1 (one item without parallel calls). No count bound but ``max_tokens``, as
  vLLM's: an answer cut there mid-call is text, finish reason ``length``;
* ``{"type": "function", "function": {"name": ...}}``: exactly one call of the named function,
  whatever ``parallel_tool_calls`` says (OpenAI forces that function; one call of it).

``parallel_tool_calls`` false also keeps only the first call of an ``auto`` answer.

Malformed fields raise :class:`~edserve.chat.errors.ChatFormatError` naming them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edserve.chat.call_scan import CallScanner, no_constant
from edserve.chat.errors import ChatFormatError

MAX_TOOLS = 128
CALL_SEPARATOR = "; "  # between the calls of a forced answer that may make several
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
PREAMBLE = ("Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n")
ENVIRONMENT = "Environment: ipython\n"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # {} only


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object as text (OpenAI's shape): the
    model's own text of it, verbatim, which a stream sends in pieces."""

    name: str
    arguments: str
    id: str = ""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """Checked ``tools`` + ``tool_choice`` (+ ``parallel_tool_calls``). ``functions``: the
    ``function`` objects as given (shown to the model); ``choice``: none / auto / required /
    function (then ``name``); ``parallel`` False: at most one call."""

    functions: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def shown(self) -> tuple[dict, ...]:
        """The functions the prompt lists (none for ``tool_choice: "none"``)."""
        return () if self.choice == "none" else self.functions

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def separator(self) -> str | None:
        """What a forced answer writes between its calls when it may make several
        (``required`` with parallel calls); None when it makes exactly one."""
        return CALL_SEPARATOR if self.choice == "required" and self.parallel else None

    @property
    def calls_finish(self) -> str:
        """The finish reason of an answer that made calls: ``tool_calls``, except ``stop``
        when ``tool_choice`` named the function (as OpenAI and vLLM answer)."""
        return "stop" if self.choice == "function" else "tool_calls"


def _fail(message: str, param: str) -> ChatFormatError:
    return ChatFormatError(message, param)


def _function(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise _fail(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise _fail(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _fail(f"{where}.function.description must be a string", "tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise _fail(f"{where}.function.parameters must be a JSON Schema object", "tools")
    return {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}


def parse_tools(tools: Any, tool_choice: Any = None, parallel: Any = True
                ) -> ToolRequest | None:
    """The checked request; None when there is nothing to do (no tools, or no tools and
    ``tool_choice`` ``"none"``). ``parallel``: OpenAI's ``parallel_tool_calls``."""
    if not isinstance(parallel, bool):
        raise _fail("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise _fail("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _fail("'tools' lists a function name twice", "tools")
    if tool_choice is None or tool_choice in CHOICES:
        return ToolRequest(functions, tool_choice or "auto", parallel=parallel)
    named = tool_choice.get("function") if isinstance(tool_choice, dict) \
        and tool_choice.get("type") == "function" else None
    if not isinstance(named, dict) or not isinstance(named.get("name"), str):
        raise _fail("'tool_choice' must be none, auto, required or {'type': 'function', "
                    "'function': {'name': ...}}", "tool_choice")
    if named["name"] not in names:
        raise _fail(f"'tool_choice' names {named['name'][:64]!r}, which 'tools' does not list",
                    "tool_choice")
    return ToolRequest(functions, "function", named["name"], parallel)


def tools_preamble(functions: Sequence[dict]) -> str:
    """The text put before the first user message's content."""
    listed = "".join(json.dumps({"type": "function", "function": f}, indent=4,
                                ensure_ascii=False) + "\n\n" for f in functions)
    return PREAMBLE + listed


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it (for assistant turns in the history)."""
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def call_schema(req: ToolRequest) -> dict:
    """JSON Schema of one forced call: ``{"name": <const>, "parameters": <its schema>}`` (of
    any listed function: ``anyOf``; of the named one). A forced answer is one such call, or
    with :attr:`ToolRequest.separator` one or more, that between them.

    Each function's ``$defs`` / ``definitions`` move to the root, where its ``#/$defs/...``
    references still resolve; a reference elsewhere into the function's schema (``#``,
    ``#/properties/...``) would point into the wrapper, so it is refused (ChatFormatError
    naming ``tools``), as are two functions defining one name differently."""
    defs: dict[str, dict] = {}

    def one(f: dict) -> dict:
        params = dict(f.get("parameters") or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise _fail(f"two functions define {key} {name!r:.40} differently; "
                                "a forced tool_choice needs one meaning per name", "tools")
        for ref in _refs(params):
            if not ref.startswith(("#/$defs/", "#/definitions/")) and ref.startswith("#"):
                raise _fail(f"function {f['name']!r}: a forced tool_choice supports "
                            f"references into $defs only, not {ref!r:.40}", "tools")
        return {"type": "object", "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {"name": {"const": f["name"]}, "parameters": params}}
    chosen = [f for f in req.functions if req.choice != "function" or f["name"] == req.name]
    schema = one(chosen[0]) if len(chosen) == 1 else {"anyOf": [one(f) for f in chosen]}
    return {**schema, **defs}


def _refs(node: Any) -> list[str]:
    """Every ``$ref`` value inside a schema."""
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def parse_calls(text: str, req: ToolRequest) -> list[ToolCall] | None:
    """The calls ``text`` makes (each ``{"name", "parameters" | "arguments"}`` of a listed
    function, separated by ``;`` or whitespace); None when it is not wholly calls (then it
    is the answer's text). Each call's ``arguments`` is the model's own text of its arguments
    object, verbatim (valid JSON; :mod:`edserve.chat.call_scan` has the rules), which is what
    a stream sends piece by piece."""
    found = CallScanner({f["name"] for f in req.shown}).feed(text).result()
    return [ToolCall(name, args, new_call_id()) for name, args in found] if found else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_calls(text: str, req: ToolRequest | None) -> list[ToolCall] | None:
    """The calls a whole answer makes (None: it is text, or no functions were shown);
    ``req.parallel`` False keeps the first call only (OpenAI's ``parallel_tool_calls:
    false``)."""
    if req is None or not req.shown:
        return None
    calls = parse_calls(text, req)
    return calls[:1] if calls and not req.parallel else calls


def history_call(call: Any, where: str) -> str:
    """An assistant message's ``tool_calls[k]`` (OpenAI's shape, arguments as JSON text)
    rendered as the model's own call text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _fail(f"{where} must be {{'type': 'function', 'function': {{'name', "
                    "'arguments'}}", where)
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args, parse_constant=no_constant) if isinstance(args, str) \
            else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise _fail(f"{where}.function.arguments must be a JSON object as a string", where)
    return call_text(fn["name"], parsed)
