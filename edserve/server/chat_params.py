"""``/v1/chat/completions`` request body -> :class:`ChatParams` (every field checked; an
:class:`~edserve.server.errors.APIError` 400 naming the field otherwise)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edserve.chat.chat_api import normalize_stop
from edserve.chat.errors import ChatFormatError
from edserve.chat.response_format import structured_grammar
from edserve.chat.sampling_filters import BIAS_LIMIT, PENALTY_LIMIT
from edserve.chat.tools import ToolRequest, parse_tools
from edserve.engine.request import MAX_TOP_LOGPROBS
from edserve.server.chat_schemas import SEED_MAX, SEED_MIN
from edserve.server.checks import show
from edserve.server.errors import APIError


@dataclass(frozen=True)
class ChatParams:
    model: str
    messages: list
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool = False  # each token's log-probability in the response (chat_logprobs)
    top_logprobs: int = 0  # with logprobs: each token's most likely alternatives (0..20)
    logit_bias: dict[int, float] | None = None  # token id -> added logit
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    response_format: Any = None  # OpenAI's object; compiled when the request is prepared
    tools: ToolRequest | None = None  # tools + tool_choice + parallel_tool_calls, checked
    structured_outputs: dict | None = None  # vLLM's object (checked), from it or guided_*
    n: int = 1  # choices: one engine request each (chat_api.choice_request)


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not (lo < v if lo_open else lo <= v) or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"'{name}' must be a number in {rng}, got {show(v)}", name,
                       "invalid_value")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int = 2**31 - 1) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {show(v)}",
                       name, "invalid_value")
    return v


# Fields that change what is generated or returned, which this server does not implement:
# refused when set to anything but their no-op value, never silently ignored.
# (field, is its value a no-op?)
# vLLM's sampling extensions (sent through the openai client's extra_body) are among them:
# a client that asks for top_k or a repetition penalty must not get plain sampling silently.
UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("functions", lambda v: not v),
    ("function_call", lambda v: v in (None, "none")),
    ("guided_whitespace_pattern", lambda v: v is None),
    ("top_k", lambda v: v in (None, -1, 0)),
    ("min_p", lambda v: v in (None, 0)),
    ("repetition_penalty", lambda v: v in (None, 1)),
    ("min_tokens", lambda v: v in (None, 0)),
    ("ignore_eos", lambda v: v in (None, False)),
    ("best_of", lambda v: v in (None, 1)),
    ("use_beam_search", lambda v: v in (None, False)),
    ("prompt_logprobs", lambda v: v in (None, 0)),
    ("echo", lambda v: v in (None, False)),
    ("stop_token_ids", lambda v: not v),
    ("bad_words", lambda v: not v),
    ("allowed_token_ids", lambda v: v is None),
    ("include_stop_str_in_output", lambda v: v in (None, False)),
    ("skip_special_tokens", lambda v: v in (None, True)),
    ("spaces_between_special_tokens", lambda v: v in (None, True)),
    ("length_penalty", lambda v: v in (None, 1)),
    ("truncate_prompt_tokens", lambda v: v is None),
    ("add_generation_prompt", lambda v: v in (None, True)),
    ("continue_final_message", lambda v: v in (None, False)),
    ("chat_template", lambda v: v is None),
    ("chat_template_kwargs", lambda v: not v),
)


def _refuse_unsupported(body: dict) -> None:
    for name, no_op in UNSUPPORTED:
        value = body.get(name)
        if not no_op(value):
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:40] + "..."
            raise APIError(400, f"'{name}' is not supported by this server (got {shown}); "
                           "omit it", name, "unsupported_value")


def parse_params(body: Any) -> ChatParams:
    """Validate the JSON body (APIError 400 naming the field)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise APIError(400, "'model' is required", "model", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' is required: a non-empty list of messages", "messages",
                       "missing_required_parameter" if messages is None else "invalid_value")
    _refuse_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    try:
        stop = normalize_stop(body.get("stop"))
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), "stop", "invalid_value") from None
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream", "invalid_value")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise APIError(400, "'logprobs' must be a boolean", "logprobs", "invalid_value")
    top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:  # as OpenAI and vLLM
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs",
                       "invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options",
                       "invalid_value")
    if not isinstance(opts.get("include_usage", False), bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean",
                       "stream_options", "invalid_value")
    return ChatParams(
        model=body["model"], messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_int(body, "seed", SEED_MIN, SEED_MAX),
        stop=stop, stream=stream, include_usage=bool(opts.get("include_usage")),
        logprobs=logprobs, top_logprobs=top_logprobs,
        logit_bias=_logit_bias(body.get("logit_bias")),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        presence_penalty=_number(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        response_format=body.get("response_format"), tools=_tools(body),
        structured_outputs=_structured(body), n=_int(body, "n", 1, MAX_N) or 1)


MAX_N = 16  # most choices per request


# vLLM's older per-kind fields -> the key of its ``structured_outputs`` object
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _structured(body: dict) -> dict | None:
    """vLLM's ``structured_outputs`` or one ``guided_*`` field as that object, checked (its
    grammar compiles: a 400 naming the field otherwise)."""
    given = [k for k in ("structured_outputs", *GUIDED) if body.get(k) is not None]
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}", given[1], "invalid_value")
    if not given:
        return None
    name = given[0]
    spec = body[name] if name == "structured_outputs" else {GUIDED[name]: body[name]}
    try:
        structured_grammar(spec, param=name)
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    return spec



def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean", name, "invalid_value")
    return v


def _tools(body: dict) -> ToolRequest | None:
    try:
        return parse_tools(body.get("tools"), body.get("tool_choice"),
                           _bool(body, "parallel_tool_calls", True))
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None


def _logit_bias(value: Any) -> dict[int, float] | None:
    """``{"token id": bias}`` (ids as decimal strings, bias in [-100, 100]) as ints -> floats;
    the ids are checked against the vocabulary when the request is prepared."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "'logit_bias' must be an object of token id -> bias", "logit_bias",
                       "invalid_value")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            raise APIError(400, f"'logit_bias' keys must be token ids, got {show(key)}",
                           "logit_bias", "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise APIError(400, f"'logit_bias' values must be numbers in [{-BIAS_LIMIT:g}, "
                           f"{BIAS_LIMIT:g}], got {show(bias)} for token {key}", "logit_bias",
                           "invalid_value")
        out[int(key)] = float(bias)
    return out or None
