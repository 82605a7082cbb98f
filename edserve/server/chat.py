"""``POST /v1/chat/completions`` for Llama-3.2-Vision (Mllama) models (an APIRouter).

Request fields: ``model``, ``messages`` (text and ``image_url`` parts with ``data:`` URLs),
``max_tokens`` / ``max_completion_tokens``, ``temperature`` in [0, 2] (default 1, as OpenAI),
``top_p``, ``seed``, ``stop`` (string or list), ``stream``, ``stream_options.include_usage``,
``n`` (1 only), ``logprobs`` and ``top_logprobs`` (each token's log-probability and its
most likely alternatives: :mod:`.chat_logprobs`), ``logit_bias``, ``frequency_penalty`` and
``presence_penalty`` (logits filters: :mod:`edserve.chat.sampling_filters`),
``response_format`` (``json_object`` / ``json_schema``: grammar-constrained output,
:mod:`edserve.chat.response_format`). Fields that would change the output and are not
implemented (tools and functions) -> 400 when set, not ignored. Bad input -> 4xx in OpenAI's
error shape, before any work is queued. Templating and image decoding run in a worker thread;
tokens come from the shared AsyncEngine, so chat requests batch with each other. A client that
disconnects aborts its request (KV freed), and so does a matched ``stop`` string.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edserve.chat.chat_api import ChatDecoder, finish_reason, normalize_stop
from edserve.chat.chat_api import prepare_chat as _prepare_chat
from edserve.chat.mllama_chat import ChatFormatError
from edserve.chat.sampling_filters import BIAS_LIMIT, PENALTY_LIMIT
from edserve.engine.errors import RequestFailed
from edserve.engine.request import MAX_TOP_LOGPROBS
from edserve.multimodal.errors import ImageInputError
from edserve.server import chat_logprobs
from edserve.server.chat_schemas import SEED_MAX, SEED_MIN
from edserve.server.checks import check_auth, check_model, read_json, show
from edserve.server.disconnect import ClientGone, unless_disconnected
from edserve.server.errors import APIError
from edserve.server.openapi import chat_operation
from edserve.server.sse import sse_response

router = APIRouter()


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
UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("tool_choice", lambda v: v in (None, "none")),
    ("functions", lambda v: not v),
    ("function_call", lambda v: v in (None, "none")),
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
    if body.get("n") not in (None, 1):
        raise APIError(400, "only n=1 is supported", "n", "unsupported_value")
    if body.get("tools"):
        raise APIError(400, "tools are not supported by this server", "tools",
                       "unsupported_value")
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
        response_format=body.get("response_format"))


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


def _prepare(client: Any, p: ChatParams):
    """Worker thread: template, tokenize, decode images, dry-run the engine's validation."""
    request, tok = _prepare_chat(client, p.messages, p.max_tokens, p.temperature, p.seed,
                                 p.top_p, allow_local_images=False, logit_bias=p.logit_bias,
                                 frequency_penalty=p.frequency_penalty,
                                 presence_penalty=p.presence_penalty,
                                 top_logprobs=p.top_logprobs,
                                 response_format=p.response_format)
    client.validate(request)  # ValueError: prompt too long, or can never fit the KV cache
    room = client.max_decoder_len - len(request.prompt_ids)
    if p.max_tokens is not None and p.max_tokens > room:  # as vLLM / OpenAI: not cut silently
        raise ChatFormatError(f"max_tokens {p.max_tokens} exceeds what the context leaves: "
                              f"{client.max_decoder_len} positions, {len(request.prompt_ids)} "
                              f"taken by the prompt, so at most {room}", "max_tokens")
    return request, tok


async def prepare(request: Request, p: ChatParams):
    try:
        return await asyncio.to_thread(_prepare, request.app.state.engine, p)
    except ImageInputError as exc:
        raise APIError(400, str(exc), "messages", "invalid_image") from None
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    except ValueError as exc:
        raise APIError(400, str(exc), None, "invalid_value") from None


async def _deltas(client: Any, gen_request: Any, decoder: ChatDecoder, result: dict,
                  with_logprobs: bool = False) -> AsyncIterator[tuple[str, list[dict] | None]]:
    """(text, logprob entries) of one request as they become final (entries: those of the
    tokens consumed since the last yield, None unless ``with_logprobs``);
    ``result["finish_reason"]`` is set at the end. Leaving early (stop string, disconnect,
    cancellation) aborts the engine request."""
    stream = client.stream(gen_request)
    output = None
    pending: list[dict] | None = [] if with_logprobs else None
    try:
        async for delta in stream:
            consumed = len(decoder.token_ids)
            text = decoder.push(delta.token_ids)
            if pending is not None:
                n = len(decoder.token_ids) - consumed  # tokens the decoder took (stop: fewer)
                pending += chat_logprobs.entries(decoder.tokenizer, delta.token_ids[:n],
                                                 delta.logprobs[:n], delta.top_logprobs[:n])
            if text:
                yield text, pending
                pending = [] if with_logprobs else None
            if delta.finished:
                output = delta.output
            if decoder.stopped or delta.finished:
                break
    finally:
        await stream.aclose()
    result["finish_reason"] = finish_reason(output, decoder)
    tail = decoder.flush()
    if tail or pending:
        yield tail, pending


def _usage(gen_request: Any, decoder: ChatDecoder) -> dict[str, int]:
    n, m = len(gen_request.prompt_ids), len(decoder.token_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def _complete(client: Any, gen_request: Any, decoder: ChatDecoder,
                    with_logprobs: bool) -> dict:
    result: dict = {"logprobs": [] if with_logprobs else None}
    async for _, entries in _deltas(client, gen_request, decoder, result, with_logprobs):
        if entries:
            result["logprobs"] += entries
    return result


async def _non_streaming(request: Request, p: ChatParams, gen_request: Any,
                         decoder: ChatDecoder, head: dict) -> Response:
    try:
        result = await unless_disconnected(
            request, _complete(request.app.state.engine, gen_request, decoder, p.logprobs))
    except ClientGone:
        return Response(status_code=499)  # the client is gone; nobody reads this
    except RequestFailed as exc:
        raise APIError(500, str(exc), None, "engine_error") from None
    message = {"role": "assistant", "content": decoder.text}
    return JSONResponse({**head, "object": "chat.completion", "choices": [
        {"index": 0, "message": message,
         "logprobs": chat_logprobs.choice_logprobs(result["logprobs"]),
         "finish_reason": result["finish_reason"]}], "usage": _usage(gen_request, decoder)})


def _chunk(head: dict, delta: dict, finish: str | None, logprobs: list[dict] | None = None
           ) -> dict:
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta,
                         "logprobs": chat_logprobs.choice_logprobs(logprobs),
                         "finish_reason": finish}]}


async def _chunks(client: Any, p: ChatParams, gen_request: Any, decoder: ChatDecoder,
                  head: dict) -> AsyncIterator[dict]:
    yield _chunk(head, {"role": "assistant", "content": ""}, None)
    result: dict = {}
    async for text, entries in _deltas(client, gen_request, decoder, result, p.logprobs):
        yield _chunk(head, {"content": text}, None, entries)
    yield _chunk(head, {}, result["finish_reason"])
    if p.include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [],
               "usage": _usage(gen_request, decoder)}


@router.post("/v1/chat/completions", openapi_extra=chat_operation())
async def chat_completions(request: Request) -> Response:
    check_auth(request)
    state = request.app.state
    if not state.engine.is_mllama:
        raise APIError(400, "this server serves a Whisper (speech) model; "
                       "/v1/chat/completions needs a Llama-3.2-Vision (Mllama) model. Use "
                       "/v1/audio/transcriptions", "model", "unsupported_task")
    p = parse_params(await read_json(request))
    check_model(request, p.model)
    gen_request, tok = await prepare(request, p)
    decoder = ChatDecoder(tok, p.stop)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": p.model, "system_fingerprint": None}
    if p.stream:
        return sse_response(_chunks(state.engine, p, gen_request, decoder, head), "generation",
                            done=True)
    return await _non_streaming(request, p, gen_request, decoder, head)
