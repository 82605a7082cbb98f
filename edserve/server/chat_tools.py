"""Tool calls in streamed ``/v1/chat/completions`` answers, sent in pieces as they are written
(as OpenAI and vLLM stream them); :mod:`edserve.chat.tools` has the format.

An answer is read by the :class:`~edserve.chat.call_scan.CallScanner` that also reads whole
answers (:func:`~edserve.chat.tools.answer_calls`), so both paths decide alike:

* without functions in the prompt, and from the first character of an answer that cannot be
  calls (the first non-space is not ``{``, or an object turns out not to be a call of a
  listed function: unknown name, not JSON, no arguments object, ...), the answer is text:
  ``content`` deltas; what was held until then goes out first, in one delta;
* once a call's name is complete, names a listed function and its arguments object has begun,
  the answer is calls: call ``k`` gets one delta ``{"index": k, "id", "type": "function",
  "function": {"name", "arguments": ""}}``, then deltas ``{"index": k, "function":
  {"arguments": <the next characters of its arguments object>}}``. The arguments of the
  non-streamed answer are the model's own text of that object, so the pieces for ``k``
  concatenate to exactly that string; with ``parallel_tool_calls`` false only call 0 is sent.
  The last chunk's finish reason is ``ToolRequest.calls_finish``;
* an answer that has started to stream as calls and then is not wholly calls (cut by
  ``max_tokens`` or a stop string, text after a call, a later object that is not a call, JSON
  that does not parse) cannot take back what was sent: the stream sends nothing more of it
  and ends with the generation's own finish reason (``length`` or ``stop``, never
  ``tool_calls``), while the non-streamed answer is that text (``content``). A forced
  ``tool_choice`` answers calls by grammar, so only a cut ends it so (``required`` with
  parallel calls may go on writing calls until ``max_tokens`` cuts one).

Log-probability entries go out in order, each exactly once: a token's entries ride on the next
delta sent (held text's on its first delta, the call syntax's on the header or argument delta
that follows), and those left at the end on the finish chunk (returned by :meth:`finish`).
"""

from __future__ import annotations

from typing import NamedTuple

from edserve.chat.call_scan import CallScanner
from edserve.chat.tools import ToolCall, ToolRequest, answer_calls, new_call_id

Deltas = list[tuple[dict, list[dict] | None]]  # (delta, log-probability entries) per chunk


class Finished(NamedTuple):
    """The end of a streamed answer: ``deltas`` still to send, ``entries`` for the finish
    chunk, and ``calls`` (None: the answer is not calls, its finish reason is the engine's)."""

    deltas: Deltas
    entries: list[dict] | None
    calls: list[ToolCall] | None


class CallCollector:
    """One streamed answer: :meth:`feed` returns the deltas that may be sent now (each with
    its log-probability entries), :meth:`finish` what is left and the calls."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self.tools = tools
        shown = tools.shown if tools is not None else ()
        self.scanner = CallScanner({f["name"] for f in shown}) if shown else None
        self.mode = "held" if shown else "text"  # held (undecided) -> text | calls
        self.sent: list[tuple[str, int]] = []  # per call sent: (its id, argument chars sent)
        self.entries: list[dict] | None = None

    def feed(self, text: str, entries: list[dict] | None) -> Deltas:
        if self.mode == "text":
            return [({"content": text}, entries)] if text or entries else []
        if entries is not None:
            self.entries = self.entries if self.entries is not None else []
            self.entries += entries
        self.scanner.feed(text)
        deltas = self._call_deltas()  # calls named before a failure in this text still count
        if self.mode == "held" and self.scanner.failed:
            self.mode = "text"
            deltas = [{"content": self.scanner.text}]
        return self._carry(deltas)

    def finish(self) -> Finished:
        if self.mode == "text":
            return Finished([], None, None)
        if self.mode == "held":  # never became calls: an unfinished object, or only spaces
            text = self.scanner.text
            deltas = self._carry([{"content": text}] if text else [])
            return Finished(deltas, self.entries or None, None)
        calls = answer_calls(self.scanner.text, self.tools)
        if calls is None or [(c.name, c.arguments) for c in calls] != self._streamed():
            return Finished([], self.entries or None, None)  # see the module's docstring
        return Finished([], self.entries or None, [
            ToolCall(c.name, c.arguments, sent[0]) for c, sent in zip(calls, self.sent,
                                                                      strict=True)])

    def _call_deltas(self) -> list[dict]:
        """Headers and argument pieces of what the scanner has read since the last call."""
        out, text, upto = [], self.scanner.text, self.scanner.pos
        for k, call in enumerate(self.scanner.calls[:None if self.tools.parallel else 1]):
            if not call.named:
                break
            if k == len(self.sent):
                self.mode = "calls"
                self.sent.append((new_call_id(), 0))
                out.append({"tool_calls": [{"index": k, "id": self.sent[k][0],
                                            "type": "function", "function": {
                                                "name": call.name, "arguments": ""}}]})
            call_id, done = self.sent[k]
            end = upto if call.args_end is None else min(call.args_end, upto)
            piece = text[call.args_start + done:end]
            if piece:
                self.sent[k] = (call_id, done + len(piece))
                out.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        return out

    def _streamed(self) -> list[tuple[str, str]]:
        """(name, arguments sent) of each call sent."""
        calls = self.scanner.calls
        return [(calls[k].name, self.scanner.text[calls[k].args_start:
                                                  calls[k].args_start + done])
                for k, (_, done) in enumerate(self.sent)]

    def _carry(self, deltas: list[dict]) -> Deltas:
        """``deltas`` paired with log-probability entries: the held ones on the first."""
        if not deltas:
            return []
        entries, self.entries = self.entries, None
        return [(d, entries if i == 0 else None) for i, d in enumerate(deltas)]
