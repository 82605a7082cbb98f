"""Python chat API for Mllama engines: ``chat(engine, messages, ...) -> ChatResult``.

Shared with the HTTP server (``edserve.server.chat``): :func:`prepare_chat` turns messages into
an engine request, and :class:`ChatDecoder` turns the generated tokens into text, applying
``stop`` strings (the text is cut before the first stop string and the request finishes).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from edserve.chat.grammar_filter import GrammarFilter
from edserve.chat.mllama_chat import DEFAULT_DATE, ChatFormatError, ChatTokenizer, chat_prompt_ids
from edserve.chat.mllama_request import make_mllama_request
from edserve.chat.response_format import response_grammar, schema_grammar, structured_grammar
from edserve.chat.sampling_filters import chat_filters
from edserve.chat.tools import ToolCall, ToolRequest, answer_calls, call_schema, parse_tools
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams, next_rid

MAX_STOP_STRINGS = 16
SEED_LIMIT = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (ValueError otherwise)."""
    if stop is None:
        return ()
    if not isinstance(stop, (str, list, tuple)):
        raise ValueError(f"'stop' must be a string or a list of strings, not "
                         f"{type(stop).__name__}")
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"'stop' must be a non-empty string or a list of at most "
                         f"{MAX_STOP_STRINGS} non-empty strings")
    return tuple(dict.fromkeys(items))


class ChatDecoder:
    """Incremental detokenizer with stop strings.

    :meth:`push` takes new token ids and returns the text that became final; the concatenation
    of everything returned (plus :meth:`flush`) equals :attr:`text`. Text that might still grow
    into a stop string, and a trailing incomplete UTF-8 character (U+FFFD), are held back.
    Once a stop string appears, :attr:`stopped` is set, :attr:`text` ends before it and further
    tokens are ignored; :attr:`token_ids` are the tokens consumed until then.
    """

    def __init__(self, tokenizer: ChatTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.stopped = False
        self._full = ""  # decode(token_ids), up to the stop string once stopped
        self._sent = 0
        self._searched = 0

    @property
    def text(self) -> str:
        return self._full

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self._full = self.tokenizer.decode(self.token_ids)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, self._searched - longest + 1)
            hits = [i for i in (self._full.find(s, start) for s in self.stop) if i >= 0]
            self._searched = len(self._full)
            if hits:
                self._full = self._full[:min(hits)]
                self.stopped = True
                return self.flush()
        return self._emit(len(self._full) - self._held_back())

    def flush(self) -> str:
        """Everything not yet returned (call once the request has finished)."""
        return self._emit(len(self._full))

    def _held_back(self) -> int:
        text = self._full
        n = len(text) - len(text.rstrip("\ufffd"))
        for k in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return max(n, k)
        return n

    def _emit(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self._full[self._sent:end]
        self._sent = end
        return out


@dataclass
class ChatResult:
    """One chat completion. ``finish_reason``: ``"stop"`` (end-of-turn token or a stop
    string), ``"length"`` (``max_tokens`` or the context limit) or ``"tool_calls"`` (the
    answer is ``tool_calls``, ``text`` keeping the model's JSON; ``"stop"`` when
    ``tool_choice`` named the function, as OpenAI). ``top_logprobs`` leaves out tokens a
    grammar ruled out (``-inf``)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    # each completion token's log-probability (as GenerateOutput.logprobs) and, with
    # top_logprobs, its most likely alternatives ((token id, log-prob), best first)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def prepare_chat(engine: Any, messages: Sequence[Any], max_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None, top_p: float = 1.0,
                 date_string: str = DEFAULT_DATE, allow_local_images: bool = True,
                 logit_bias: Mapping[int, float] | None = None, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, top_logprobs: int = 0,
                 response_format: Mapping[str, Any] | None = None,
                 tools: ToolRequest | None = None, json_whitespace: bool = True,
                 structured_outputs: Mapping[str, Any] | None = None
                 ) -> tuple[GenerateRequest, ChatTokenizer]:
    """Template, tokenize and preprocess images into a :class:`GenerateRequest` whose
    ``stop_token_ids`` are the chat's end-of-turn tokens; ``logit_bias`` and the penalties
    become its logits filters (:mod:`edserve.chat.sampling_filters`), and a
    ``response_format`` asking for JSON a grammar filter after them
    (:mod:`edserve.chat.response_format`); ``top_logprobs``: each output token's most likely
    alternatives (:attr:`GenerateOutput.top_logprobs`); ``tools`` (from
    :func:`edserve.chat.tools.parse_tools`): the functions are listed in the prompt, and a
    forced ``tool_choice`` constrains the answer to calls (one or more for ``required`` with
    parallel calls, else one); ``json_whitespace`` False makes such grammar-constrained JSON
    compact; ``structured_outputs``: vLLM's object (``json``, ``regex``, ``choice``,
    ``grammar`` or ``json_object``), instead of ``response_format``.

    Raises ``ValueError`` subclasses: ``ChatFormatError`` (messages), ``ImageInputError``
    (images), or ``ValueError`` (not an Mllama engine, bad sampling values).
    """
    if not getattr(engine, "is_mllama", False):
        raise ValueError("chat needs a Llama-3.2-Vision (Mllama) model; this engine serves "
                         f"{type(getattr(engine, 'model', None)).__name__}")
    tok = ChatTokenizer.for_model(engine.model, engine.tokenizer)
    grammar = response_grammar(response_format, json_whitespace)  # before images are decoded
    if structured_outputs is not None:
        if grammar is not None:
            raise ChatFormatError("give 'response_format' json_object / json_schema or "
                                  "'structured_outputs', not both", "structured_outputs")
        grammar = structured_grammar(structured_outputs, json_whitespace)
    shown = tools.shown if tools is not None else ()
    if grammar is not None and shown:
        raise ChatFormatError("a constrained answer ('response_format' json_object / "
                              "json_schema, 'structured_outputs') cannot be combined with "
                              "'tools' (a forced tool_choice already constrains the answer; "
                              "tool_choice 'none' drops the tools)", "response_format")
    if tools is not None and tools.forced:
        grammar = schema_grammar(call_schema(tools), json_whitespace, "tools", tools.separator)
    ids, images = chat_prompt_ids(tok, messages, date_string, allow_local_images, shown)
    sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=seed,
                              max_new_tokens=max_tokens, stop_token_ids=tok.stop_token_ids,
                              top_logprobs=top_logprobs)
    vocab = engine.model.config.text.vocab_size
    outside = sorted(k for k in (logit_bias or {}) if not 0 <= k < vocab)
    if outside:
        raise ChatFormatError(f"logit_bias token id {outside[0]} is outside the vocabulary "
                              f"(0..{vocab - 1})", "logit_bias")
    request = make_mllama_request(engine.model, ids, images, sampling)
    request.logits_processors = chat_filters(logit_bias, frequency_penalty, presence_penalty)
    if grammar is not None:
        request.logits_processors.append(GrammarFilter(grammar, tok.stop_token_ids))
    return request, tok


def choice_request(request: GenerateRequest, index: int) -> GenerateRequest:
    """Choice ``index`` of an ``n`` > 1 completion: the same prompt and images as choice 0
    (``request``), its own request id, ``seed + index`` when seeded (so the choices differ and
    each is reproducible), fresh state for filters that hold one (a grammar's matcher). Each
    choice is its own engine request; the server runs the image through the vision encoder
    once for all of them (choice 0's encoder region, :mod:`edserve.server.encoder_share`)."""
    sp = request.sampling
    seed = sp.seed
    if seed is not None:
        seed = seed + index if seed + index <= SEED_LIMIT else seed - index
    return replace(request, sampling=replace(sp, seed=seed), rid=next_rid(),
                   logits_processors=[copy.deepcopy(f) if f.per_row else f
                                      for f in request.logits_processors])


def finish_reason(output: GenerateOutput | None, decoder: ChatDecoder) -> str:
    """OpenAI finish reason; :class:`RequestFailed` (a RuntimeError) for a failed or aborted
    request."""
    if decoder.stopped:
        return "stop"
    if output is None or output.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        reason = output.error if output is not None and output.error else "aborted"
        raise RequestFailed(f"generation failed: {reason}",
                            output.rid if output is not None else None)
    return "length" if output.finish_reason == FinishReason.LENGTH else "stop"


def chat(engine: Any, messages: Sequence[Any], max_tokens: int | None = None,
         temperature: float = 0.0, seed: int | None = None,
         stop: str | Sequence[str] | None = None, top_p: float = 1.0,
         date_string: str = DEFAULT_DATE, logit_bias: Mapping[int, float] | None = None,
         frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
         top_logprobs: int = 0, response_format: Mapping[str, Any] | None = None,
         tools: Sequence[dict] | None = None, tool_choice: Any = None,
         parallel_tool_calls: bool = True, json_whitespace: bool = True,
         structured_outputs: Mapping[str, Any] | None = None) -> ChatResult:
    """Run one chat completion on a (synchronous) :class:`~edserve.engine.engine.Engine`.

    ``messages`` as in :func:`~edserve.chat.mllama_chat.render_chat` (images may also be
    PIL images, bytes or file paths here). ``max_tokens`` None: the engine's
    ``max_new_tokens``. ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible;
    ``logit_bias`` and the penalties as in OpenAI's API (:mod:`.sampling_filters`);
    ``top_logprobs``: each completion token's most likely alternatives in the result;
    ``response_format`` as OpenAI's (``json_object`` / ``json_schema``: the text is JSON);
    ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI's
    (:mod:`edserve.chat.tools`: calls come back in ``tool_calls``; ``json_whitespace`` False:
    that JSON compact); ``structured_outputs``: vLLM's (``regex``, ``choice``, ``grammar``,
    ``json``). Bad input raises ``ValueError`` (``ChatFormatError`` / ``ImageInputError``).
    """
    request, tok = prepare_chat(engine, messages, max_tokens, temperature, seed, top_p,
                                date_string, logit_bias=logit_bias,
                                frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, top_logprobs=top_logprobs,
                                response_format=response_format,
                                tools=(wanted := parse_tools(tools, tool_choice,
                                                             parallel_tool_calls)),
                                json_whitespace=json_whitespace,
                                structured_outputs=structured_outputs)
    decoder = ChatDecoder(tok, normalize_stop(stop))
    done: list[GenerateOutput | None] = []

    def on_delta(delta) -> None:
        was_stopped = decoder.stopped
        decoder.push(delta.token_ids)
        if decoder.stopped and not was_stopped and not delta.finished:
            engine.abort(request.rid)  # stop string: free the row and KV now
        if delta.finished:
            done.append(delta.output)

    engine.add_request(request, on_delta)
    while not done:
        engine.step()
    reason = finish_reason(done[0], decoder)
    decoder.flush()
    n, out = len(decoder.token_ids), done[0]  # a stop string may have cut tokens
    calls = answer_calls(decoder.text, wanted)
    if calls:
        reason = wanted.calls_finish
    top = [[(t, lp) for t, lp in alts if lp > -math.inf] for alts in out.top_logprobs[:n]]
    return ChatResult(decoder.text, reason, len(request.prompt_ids), n,
                      list(decoder.token_ids), list(out.logprobs[:n]), top, calls or [])
