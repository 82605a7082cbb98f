"""``POST /v1/chat/completions`` for Llama-3.2-Vision (Mllama) models (an APIRouter).

Request fields: ``model``, ``messages`` (text and ``image_url`` parts with ``data:`` URLs),
``max_tokens`` / ``max_completion_tokens``, ``temperature`` in [0, 2] (default 1, as OpenAI),
``top_p``, ``seed``, ``stop`` (string or list), ``stream``, ``stream_options.include_usage``,
``n`` (1 only). Bad input -> 4xx in OpenAI's error shape, before any work is queued. Templating
and image decoding run in a worker thread; tokens come from the shared AsyncEngine, so chat
requests batch with each other. A client that disconnects aborts its request (KV freed), and
so does a matched ``stop`` string.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from edserve.multimodal.chat_api import ChatDecoder, finish_reason, is_mllama, normalize_stop
from edserve.multimodal.chat_api import prepare_chat as _prepare_chat
from edserve.multimodal.errors import ImageInputError
from edserve.multimodal.mllama_chat import ChatFormatError
from edserve.server.disconnect import ClientGone, unless_disconnected
from edserve.server.errors import APIError, error_body

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


def require_audio_model(request: Request) -> None:
    """400 when the served model cannot take audio (called by the audio endpoints)."""
    if is_mllama(request.app.state.aengine.engine):
        raise APIError(400, "this server serves a Llama-3.2-Vision (Mllama) model, which does "
                       "not take audio; use /v1/chat/completions", "model", "unsupported_task")


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not (lo < v if lo_open else lo <= v) or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"'{name}' must be a number in {rng}, got {v!r}", name,
                       "invalid_value")
    return float(v)


def _int(body: dict, name: str, lo: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise APIError(400, f"'{name}' must be an integer{bound}, got {v!r}", name,
                       "invalid_value")
    return v


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
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    try:
        stop = normalize_stop(body.get("stop"))
    except ValueError as exc:
        raise APIError(400, str(exc), "stop", "invalid_value") from None
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream", "invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    return ChatParams(
        model=body["model"], messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=_int(body, "seed", None),
        stop=stop, stream=stream, include_usage=bool(opts.get("include_usage")))


def _prepare(engine: Any, p: ChatParams):
    """Worker thread: template, tokenize, decode images, dry-run the engine's validation."""
    request, tok = _prepare_chat(engine, p.messages, p.max_tokens, p.temperature, p.seed,
                                 p.top_p, allow_local_images=False)
    req = engine.make_req(request)  # ValueError: prompt too long for the context
    total = engine.pools.allocator.size
    if req.reserved_slots > total:
        raise ValueError(f"prompt + max_tokens need {req.reserved_slots} KV slots but the cache "
                         f"holds {total}; lower max_tokens")
    return request, tok


async def prepare(request: Request, p: ChatParams):
    engine = request.app.state.aengine.engine
    try:
        return await asyncio.to_thread(_prepare, engine, p)
    except ImageInputError as exc:
        raise APIError(400, str(exc), "messages", "invalid_image") from None
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    except ValueError as exc:
        raise APIError(400, str(exc), None, "invalid_value") from None


async def _deltas(aengine: Any, gen_request: Any, decoder: ChatDecoder,
                  result: dict) -> AsyncIterator[str]:
    """Text deltas of one request; ``result["finish_reason"]`` is set at the end. Leaving
    early (stop string, disconnect, cancellation) aborts the engine request."""
    stream = aengine.stream(gen_request)
    output = None
    try:
        async for delta in stream:
            text = decoder.push(delta.token_ids)
            if text:
                yield text
            if delta.finished:
                output = delta.output
            if decoder.stopped or delta.finished:
                break
    finally:
        await stream.aclose()
    result["finish_reason"] = finish_reason(output, decoder)
    tail = decoder.flush()
    if tail:
        yield tail


def _usage(gen_request: Any, decoder: ChatDecoder) -> dict[str, int]:
    n, m = len(gen_request.prompt_ids), len(decoder.token_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def _complete(aengine: Any, gen_request: Any, decoder: ChatDecoder) -> dict:
    result: dict = {}
    async for _ in _deltas(aengine, gen_request, decoder, result):
        pass
    return result


async def _non_streaming(request: Request, p: ChatParams, gen_request: Any,
                         decoder: ChatDecoder, head: dict) -> Response:
    try:
        result = await unless_disconnected(
            request, _complete(request.app.state.aengine, gen_request, decoder))
    except ClientGone:
        return Response(status_code=499)  # the client is gone; nobody reads this
    except RuntimeError as exc:
        raise APIError(500, str(exc), None, "engine_error") from None
    message = {"role": "assistant", "content": decoder.text}
    return JSONResponse({**head, "object": "chat.completion", "choices": [
        {"index": 0, "message": message, "logprobs": None,
         "finish_reason": result["finish_reason"]}], "usage": _usage(gen_request, decoder)})


def _chunk(head: dict, delta: dict, finish: str | None) -> str:
    body = {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _sse(aengine: Any, p: ChatParams, gen_request: Any, decoder: ChatDecoder,
               head: dict) -> AsyncIterator[str]:
    yield _chunk(head, {"role": "assistant", "content": ""}, None)
    result: dict = {}
    try:
        async for text in _deltas(aengine, gen_request, decoder, result):
            yield _chunk(head, {"content": text}, None)
    except RuntimeError as exc:
        yield f"data: {json.dumps(error_body(500, str(exc), None, 'engine_error'))}\n\n"
        yield "data: [DONE]\n\n"
        return
    yield _chunk(head, {}, result["finish_reason"])
    if p.include_usage:
        usage = {**head, "object": "chat.completion.chunk", "choices": [],
                 "usage": _usage(gen_request, decoder)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    from edserve.server.app import _check_auth  # app.py includes this router

    _check_auth(request)
    state = request.app.state
    if not is_mllama(state.aengine.engine):
        raise APIError(400, "this server serves a Whisper (speech) model; "
                       "/v1/chat/completions needs a Llama-3.2-Vision (Mllama) model. Use "
                       "/v1/audio/transcriptions", "model", "unsupported_task")
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    p = parse_params(body)
    if p.model != state.config.served_model_name:
        raise APIError(404, f"The model '{p.model}' does not exist; this server serves "
                       f"'{state.config.served_model_name}'", "model", "model_not_found")
    gen_request, tok = await prepare(request, p)
    decoder = ChatDecoder(tok, p.stop)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": p.model, "system_fingerprint": None}
    if p.stream:
        return StreamingResponse(_sse(state.aengine, p, gen_request, decoder, head),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _non_streaming(request, p, gen_request, decoder, head)
