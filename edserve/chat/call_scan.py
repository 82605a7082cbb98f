"""An answer read as Llama 3 JSON calls, a character at a time (:class:`CallScanner`).

One scanner serves both paths: :func:`edserve.chat.tools.parse_calls` feeds it a whole answer,
the server's stream collector (:mod:`edserve.server.chat_tools`) feeds it the answer as it
arrives and streams each call's arguments as their characters come. It reads one character at
a time and keeps no look-ahead, so what it has found after any prefix of the text does not
depend on how that prefix was split: the pieces a stream sends concatenate to what the whole
answer gives.

The format: after optional whitespace, one or more JSON objects ``{"name": <listed function>,
"parameters": {...}}`` (``"arguments"`` may stand for ``"parameters"``; other keys are
ignored), separated by whitespace and ``;``. A call's arguments are the model's own text of
that object, verbatim: the characters from its ``{`` to its matching ``}``, which are valid
JSON (every object is checked with :func:`json.loads` when it closes; NaN / Infinity are
refused). An object naming ``name`` twice, or giving both ``parameters`` and ``arguments``, is
not a call (which one a JSON reader keeps is not something to stream against). The scanner
*fails*, for good, at the first character that makes the answer not wholly calls.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

ARG_KEYS = ("parameters", "arguments")
_JSON_SPACE = " \t\n\r"
_SCALAR = set("0123456789+-.eE") | set("truefalsn")  # numbers, true, false, null


def no_constant(name: str) -> Any:
    """``json`` reads NaN / Infinity, which JSON does not have: refused."""
    raise ValueError(f"{name} is not JSON")


@dataclass
class ScannedCall:
    """One top-level object of the answer, as far as it has been read (offsets into the
    scanner's ``text``). ``args_start``: its arguments object's ``{``; ``args_end`` just past
    that object's ``}`` (None while it is open); ``end`` just past the call's ``}``."""

    start: int
    name: str | None = None
    name_seen: bool = False
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None

    @property
    def named(self) -> bool:
        """Its name is complete, a listed function, and its arguments object has begun:
        from here on a stream shows it as a call."""
        return self.name is not None and self.args_start is not None


class CallScanner:
    """Feed text with :meth:`feed`; ``calls`` grows as objects begin, ``failed`` turns True
    (and stays) at the first character that makes the text not wholly calls of ``names``;
    ``pos``: how many characters were read (the failing one not counted)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.text = ""
        self.pos = 0
        self.failed = False
        self.calls: list[ScannedCall] = []
        self._state = "top"  # top, key_or_close, key, colon, value, scalar, nested, after
        self._in_string = self._escape = False
        self._stack: list[str] = []  # open containers inside a value of the call object
        self._key = ""  # the call object's key being read or whose value is being read
        self._mark = 0  # where that key or value began

    def feed(self, text: str) -> CallScanner:
        self.text += text
        while not self.failed and self.pos < len(self.text):
            if self._read(self.text[self.pos], self.pos):
                self.pos += 1
            else:
                self.failed = True
        return self

    def result(self) -> list[tuple[str, str]] | None:
        """``[(name, arguments text)]`` when everything read is whole calls, else None."""
        if self.failed or self._state != "top" or not self.calls:
            return None
        return [(c.name, self.text[c.args_start:c.args_end]) for c in self.calls]

    # ---- one character ---------------------------------------------------------------------

    def _read(self, c: str, i: int) -> bool:
        """Take character ``c`` at offset ``i``; False: the text is not calls."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                return self._string_end(i + 1)
            return True
        state = self._state
        if state == "top":
            if c == "{":
                self.calls.append(ScannedCall(i))
                self._state = "key_or_close"
                return True
            return c.isspace() or (c == ";" and bool(self.calls))
        if state == "nested":
            return self._nested(c, i)
        if state == "scalar":
            if c in _SCALAR:
                return True
            if not self._value_end(i):
                return False
            state = self._state = "after"  # the delimiter is read below
        if c in _JSON_SPACE:
            return True
        if state in ("key_or_close", "key") and c == '"':
            self._state, self._mark, self._in_string = "key", i, True
            return True
        if state == "colon" and c == ":":
            self._state = "value"
            return True
        if state == "value":
            return self._value_start(c, i)
        if state == "after" and c == ",":
            self._state = "key"
            return True
        if state in ("key_or_close", "after") and c == "}":
            return self._close(i + 1)
        return False

    def _string_end(self, end: int) -> bool:
        if self._state == "key":
            try:
                self._key = json.loads(self.text[self._mark:end])
            except ValueError:
                return False
            self._state = "colon"
            return True
        if self._state == "value":  # a string value of the call object
            self._state = "after"
            return self._value_end(end)
        return True  # inside a nested value

    def _value_start(self, c: str, i: int) -> bool:
        call, self._mark = self.calls[-1], i
        if self._key == "name":
            if c != '"' or call.name_seen:
                return False
            call.name_seen = True
        elif self._key in ARG_KEYS:
            if c != "{" or call.args_start is not None:
                return False
            call.args_start = i
        if c == '"':
            self._in_string = True  # the state stays "value" until the string ends
        elif c in "{[":
            self._state, self._stack = "nested", [c]
        elif c in _SCALAR:
            self._state = "scalar"
        else:
            return False
        return True

    def _nested(self, c: str, i: int) -> bool:
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._stack.append(c)
        elif c in "}]":
            if self._stack.pop() != ("{" if c == "}" else "["):
                return False
            if not self._stack:
                self._state = "after"
                return self._value_end(i + 1)
        return True

    def _value_end(self, end: int) -> bool:
        """A value of the call object ends just before ``end``."""
        call = self.calls[-1]
        if self._key == "name":
            try:
                name = json.loads(self.text[self._mark:end])
            except ValueError:  # a bad escape or a control character
                return False
            if name not in self.names:
                return False
            call.name = name
        elif self._key in ARG_KEYS:
            call.args_end = end
        return True

    def _close(self, end: int) -> bool:
        """The call object ends just before ``end``: whole, valid JSON, a listed name and an
        arguments object, or the text is not calls."""
        call = self.calls[-1]
        if call.name is None or call.args_end is None:
            return False
        try:
            json.loads(self.text[call.start:end], parse_constant=no_constant)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
            return False
        call.end, self._state = end, "top"
        return True
