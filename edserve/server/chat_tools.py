"""Tool calls in ``/v1/chat/completions`` answers: text or ``tool_calls``, decided as the text
arrives (:mod:`edserve.chat.tools` has the format).

With functions in the prompt an answer that starts with ``{`` may be a call, so a stream holds
it back (text and log-probabilities) until the answer ends: then it is sent as one
``tool_calls`` delta when it parses as calls of the listed functions, else as text. An answer
that starts with anything else streams as text from its first character. A forced
``tool_choice`` is always held (the grammar makes it a call).
"""

from __future__ import annotations

from edserve.chat.tools import ToolCall, ToolRequest, answer_calls


class CallCollector:
    """One streamed answer: :meth:`feed` returns what may be sent now, :meth:`finish` the rest
    and the calls."""

    def __init__(self, tools: ToolRequest | None, parallel: bool = True) -> None:
        self.tools, self.parallel = tools, parallel
        shown = tools is not None and bool(tools.shown)
        # "text": pass through; "maybe": undecided until the first non-space; "held": a call?
        self.mode = "text" if not shown else "held" if tools.forced else "maybe"
        self.text = ""
        self.entries: list[dict] | None = None

    def feed(self, text: str, entries: list[dict] | None) -> tuple[str, list[dict] | None]:
        if self.mode == "text":
            return text, entries
        self.text += text
        if entries is not None:
            self.entries = self.entries or []
            self.entries += entries
        if self.mode == "maybe" and self.text.strip():
            if not self.text.lstrip().startswith("{"):
                self.mode = "text"
                return self._release()
            self.mode = "held"
        return "", None

    def finish(self) -> tuple[str, list[dict] | None, list[ToolCall] | None]:
        """(text still to send, its log-probability entries, the calls or None)."""
        if self.mode == "text":
            return "", None, None
        calls = answer_calls(self.text, self.tools, self.parallel)
        text, entries = self._release()
        return ("" if calls else text), entries, calls

    def _release(self) -> tuple[str, list[dict] | None]:
        out = (self.text, self.entries)
        self.text, self.entries = "", None
        return out


def calls_delta(calls: list[ToolCall]) -> dict:
    """The stream delta carrying every call whole (``index`` per call, OpenAI's shape)."""
    return {"tool_calls": [{"index": k, **c.openai()} for k, c in enumerate(calls)]}
