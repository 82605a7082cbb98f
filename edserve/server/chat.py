"""``POST /v1/chat/completions`` for Llama-3.2-Vision (Mllama) models (an APIRouter).

Request fields: ``model``, ``messages`` (text and ``image_url`` parts with ``data:`` URLs),
``max_tokens`` / ``max_completion_tokens``, ``temperature`` in [0, 2] (default 1, as OpenAI),
``top_p``, ``seed``, ``stop`` (string or list), ``stream``, ``stream_options.include_usage``,
``n`` (1 to 16 choices, each its own engine request; with an image they share one
vision-encoder run: :mod:`.encoder_share`), ``logprobs`` and ``top_logprobs`` (each
token's log-probability and its most likely alternatives: :mod:`.chat_logprobs`),
``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` (logits filters:
:mod:`edserve.chat.sampling_filters`), ``response_format`` (``json_object`` / ``json_schema``:
grammar-constrained output, :mod:`edserve.chat.response_format`; vLLM's ``structured_outputs``
and ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` too), ``tools``
/ ``tool_choice`` / ``parallel_tool_calls`` (Llama 3 JSON function calling:
:mod:`edserve.chat.tools`, :mod:`.chat_tools`); the body is parsed by :mod:`.chat_params`.
Fields that would change the output and are not implemented (the deprecated ``functions`` /
``function_call``) -> 400 when set, not ignored. Bad input -> 4xx in OpenAI's error shape,
before any work is queued. Templating and image decoding run in a worker thread; tokens come
from the shared AsyncEngine, so chat requests batch with each other. A client that disconnects
aborts its request (KV freed), and so does a matched ``stop`` string.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edserve.chat.chat_api import ChatDecoder, choice_request, finish_reason
from edserve.chat.chat_api import prepare_chat as _prepare_chat
from edserve.chat.errors import ChatFormatError
from edserve.chat.tools import answer_calls
from edserve.engine.errors import RequestFailed
from edserve.multimodal.errors import ImageInputError
from edserve.server import chat_logprobs
from edserve.server.chat_params import ChatParams, parse_params
from edserve.server.chat_tools import CallCollector
from edserve.server.checks import check_auth, check_model, read_json
from edserve.server.disconnect import ClientGone, unless_disconnected
from edserve.server.encoder_share import EncoderShare
from edserve.server.errors import APIError
from edserve.server.merge import merge
from edserve.server.openapi import chat_operation
from edserve.server.sse import sse_response

router = APIRouter()


def _prepare(client: Any, p: ChatParams, json_whitespace: bool = True):
    """Worker thread: template, tokenize, decode images, dry-run the engine's validation."""
    request, tok = _prepare_chat(client, p.messages, p.max_tokens, p.temperature, p.seed,
                                 p.top_p, allow_local_images=False, logit_bias=p.logit_bias,
                                 frequency_penalty=p.frequency_penalty,
                                 presence_penalty=p.presence_penalty,
                                 top_logprobs=p.top_logprobs,
                                 response_format=p.response_format, tools=p.tools,
                                 json_whitespace=json_whitespace,
                                 structured_outputs=p.structured_outputs)
    client.validate(request)  # ValueError: prompt too long, or can never fit the KV cache
    room = client.max_decoder_len - len(request.prompt_ids)
    if p.max_tokens is not None and p.max_tokens > room:  # as vLLM / OpenAI: not cut silently
        raise ChatFormatError(f"max_tokens {p.max_tokens} exceeds what the context leaves: "
                              f"{client.max_decoder_len} positions, {len(request.prompt_ids)} "
                              f"taken by the prompt, so at most {room}", "max_tokens")
    return request, tok


async def prepare(request: Request, p: ChatParams):
    try:
        state = request.app.state
        return await asyncio.to_thread(_prepare, state.engine, p, state.config.json_whitespace)
    except ImageInputError as exc:
        raise APIError(400, str(exc), "messages", "invalid_image") from None
    except ChatFormatError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None
    except ValueError as exc:
        raise APIError(400, str(exc), None, "invalid_value") from None


async def _deltas(client: Any, c: Choice, result: dict, with_logprobs: bool = False
                  ) -> AsyncIterator[tuple[str, list[dict] | None]]:
    """(text, logprob entries) of one choice as they become final (entries: those of the
    tokens consumed since the last yield, None unless ``with_logprobs``);
    ``result["finish_reason"]`` is set at the end. Leaving early (stop string, disconnect,
    cancellation) aborts the engine request. The choices' shared encoder region comes and
    goes through ``c.share`` (:mod:`.encoder_share`)."""
    decoder = c.decoder
    output = None
    pending: list[dict] | None = [] if with_logprobs else None
    try:
        stream = client.stream(await c.share.request_for(c.index, c.request))
        try:
            async for delta in stream:
                c.share.offer(c.index, delta)
                consumed = len(decoder.token_ids)
                text = decoder.push(delta.token_ids)
                if pending is not None:
                    n = len(decoder.token_ids) - consumed  # tokens taken (stop string: fewer)
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
    finally:
        if c.index == 0:
            c.share.first_ended()
    result["finish_reason"] = finish_reason(output, decoder)
    tail = decoder.flush()
    if tail or pending:
        yield tail, pending


@dataclass
class Choice:
    """One of a completion's ``n`` answers: its engine request, its detokenizer and the
    encoder region the choices share."""

    index: int
    request: Any
    decoder: ChatDecoder
    share: EncoderShare


def _usage(choices: list[Choice]) -> dict[str, int]:
    """The prompt once (as OpenAI counts it), every choice's completion tokens."""
    n = len(choices[0].request.prompt_ids)
    m = sum(len(c.decoder.token_ids) for c in choices)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def _complete(client: Any, c: Choice, with_logprobs: bool) -> dict:
    result: dict = {"logprobs": [] if with_logprobs else None}
    async for _, entries in _deltas(client, c, result, with_logprobs):
        if entries:
            result["logprobs"] += entries
    return result


async def _non_streaming(request: Request, p: ChatParams, choices: list[Choice],
                         head: dict) -> Response:
    engine = request.app.state.engine
    try:
        results = await unless_disconnected(request, _all(
            [_complete(engine, c, p.logprobs) for c in choices]))
    except ClientGone:
        return Response(status_code=499)  # the client is gone; nobody reads this
    except RequestFailed as exc:
        raise APIError(500, str(exc), None, "engine_error") from None
    finally:
        choices[0].share.close()  # every choice's stream is closed by now
    return JSONResponse({**head, "object": "chat.completion",
                         "choices": [_choice(p, c, r) for c, r in zip(choices, results,
                                                                     strict=True)],
                         "usage": _usage(choices)})


async def _all(work: list) -> list:
    """Every result; when one fails, the others are cancelled (their engine requests aborted,
    not left decoding for nobody) before the error is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _choice(p: ChatParams, c: Choice, result: dict) -> dict:
    message: dict = {"role": "assistant", "content": c.decoder.text}
    calls = answer_calls(c.decoder.text, p.tools)
    if calls:
        message = {"role": "assistant", "content": None,
                   "tool_calls": [call.openai() for call in calls]}
    return {"index": c.index, "message": message,
            "logprobs": chat_logprobs.choice_logprobs(result["logprobs"]),
            "finish_reason": p.tools.calls_finish if calls else result["finish_reason"]}


def _chunk(head: dict, index: int, delta: dict, finish: str | None,
           logprobs: list[dict] | None = None) -> dict:
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta,
                         "logprobs": chat_logprobs.choice_logprobs(logprobs),
                         "finish_reason": finish}]}


async def _choice_chunks(client: Any, p: ChatParams, c: Choice, head: dict
                         ) -> AsyncIterator[dict]:
    yield _chunk(head, c.index, {"role": "assistant", "content": ""}, None)
    result: dict = {}
    calls = CallCollector(p.tools)  # text, or calls sent in pieces
    async for text, entries in _deltas(client, c, result, p.logprobs):
        for delta, carried in calls.feed(text, entries):
            yield _chunk(head, c.index, delta, None, carried)
    end = calls.finish()
    for delta, carried in end.deltas:
        yield _chunk(head, c.index, delta, None, carried)
    yield _chunk(head, c.index, {}, p.tools.calls_finish if end.calls else
                 result["finish_reason"], end.entries)


async def _chunks(client: Any, p: ChatParams, choices: list[Choice], head: dict
                  ) -> AsyncIterator[dict]:
    """Every choice's chunks, interleaved as they come (each carries its ``index``)."""
    streams = [_choice_chunks(client, p, c, head) for c in choices]
    try:
        async for chunk in (streams[0] if len(streams) == 1 else merge(streams)):
            yield chunk
    finally:  # merge has closed every choice's stream (or the one stream ended)
        choices[0].share.close()
    if p.include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [],
               "usage": _usage(choices)}


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
    share = EncoderShare(state.engine, gen_request, p.n)  # one vision run for the n choices
    choices = [Choice(i, gen_request if i == 0 else choice_request(gen_request, i),
                      ChatDecoder(tok, p.stop), share) for i in range(p.n)]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": p.model, "system_fingerprint": None}
    if p.stream:
        return sse_response(_chunks(state.engine, p, choices, head), "generation", done=True)
    return await _non_streaming(request, p, choices, head)
