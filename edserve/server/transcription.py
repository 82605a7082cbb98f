"""The audio endpoints: validated form -> long-form transcription -> OpenAI response or SSE.

Work per request: decode the upload and compute the log-mel in a worker thread, then drive one
:class:`~edserve.whisper.longform.LongformTask` on the shared AsyncEngine (its windows batch
with every other request's). A client that disconnects aborts its request (KV freed).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioError, EmptyAudioError
from edserve.audio.mel import SAMPLE_RATE
from edserve.server.disconnect import ClientGone, unless_disconnected
from edserve.server.errors import APIError, error_body
from edserve.server.params import TranscriptionParams
from edserve.server.text_stream import TextStream
from edserve.whisper.formats import to_srt, to_text, to_vtt, verbose_dict
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions, temperature_schedule
from edserve.whisper.result import Transcription
from edserve.whisper.transcribe import make_task, transcribe_async


def check_task(tokenizer: Any, task: str, language: str | None) -> None:
    """400 for what the model cannot do (translation / other languages on English-only)."""
    if not tokenizer.is_multilingual:
        if task == "translate":
            raise APIError(400, "this model is English-only and cannot translate; use "
                           "/v1/audio/transcriptions", "model", "unsupported_task")
        if language not in (None, "en"):
            raise APIError(400, f"this model is English-only; language {language!r} is not "
                           "supported (omit it or use 'en')", "language", "unsupported_language")
        return
    if language is not None and language not in tokenizer.all_language_codes:
        raise APIError(400, f"unknown language code {language!r}", "language", "invalid_value")


def build_options(params: TranscriptionParams, task: str, cfg: Any, seed: int
                  ) -> TranscribeOptions:
    timed = params.response_format in ("srt", "vtt", "verbose_json") \
        or "segment" in params.granularities
    return TranscribeOptions(
        language=params.language, task=task,
        temperatures=temperature_schedule(params.temperature),
        compression_ratio_threshold=cfg.compression_ratio_threshold,
        logprob_threshold=cfg.logprob_threshold, no_speech_threshold=cfg.no_speech_threshold,
        condition_on_previous_text=cfg.condition_on_previous_text,
        initial_prompt=params.prompt, timestamps=True if timed else None, seed=seed)


async def prepare(app_state: Any, params: TranscriptionParams, task: str) -> LongformTask:
    """Decode, check duration, compute features (in a worker thread)."""
    aengine, cfg = app_state.aengine, app_state.config
    engine = aengine.engine
    check_task(engine.tokenizer, task, params.language)
    try:
        audio = await asyncio.to_thread(load_audio, params.audio_bytes)
    except EmptyAudioError as exc:
        raise APIError(400, f"{params.filename}: {exc}", "file", "empty_audio") from None
    except AudioError as exc:
        raise APIError(400, f"{params.filename}: {exc}", "file", "invalid_audio") from None
    seconds = len(audio) / SAMPLE_RATE
    if seconds > cfg.max_audio_seconds:
        raise APIError(400, f"audio is {seconds:.1f} s long; the limit is "
                       f"{cfg.max_audio_seconds:g} s", "file", "audio_too_long")
    options = build_options(params, task, cfg, engine.config.seed)
    try:
        return await asyncio.to_thread(make_task, engine, audio, options, params.filename)
    except EmptyAudioError as exc:
        raise APIError(400, str(exc), "file", "empty_audio") from None


def usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def render(result: Transcription, params: TranscriptionParams, task: str) -> Response:
    fmt = params.response_format
    if fmt == "json":
        return JSONResponse({"text": result.text, "usage": usage(result.duration)})
    if fmt == "verbose_json":
        return JSONResponse({**verbose_dict(result, task), "usage": usage(result.duration)})
    body = {"text": to_text, "srt": to_srt, "vtt": to_vtt}[fmt](result)
    return PlainTextResponse(body)


async def _collect(aengine: Any, task: LongformTask) -> Transcription:
    async for _ in transcribe_async(aengine, task):
        pass
    return task.result()


async def run(request: Request, params: TranscriptionParams, task_name: str) -> Response:
    """Transcribe and render; aborts the engine work if the client goes away first."""
    state = request.app.state
    start = time.perf_counter()
    task = await prepare(state, params, task_name)
    if params.stream:
        return StreamingResponse(_sse(state, task), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        result = await unless_disconnected(request, _collect(state.aengine, task))
    except ClientGone:
        return Response(status_code=499)  # the client is gone; nobody reads this
    except RuntimeError as exc:
        raise APIError(500, f"transcription failed: {exc}", None, "engine_error") from None
    state.metrics.latency.labels(task_name).observe(time.perf_counter() - start)
    state.metrics.audio_seconds.inc(result.duration)
    return render(result, params, task_name)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _sse(state: Any, task: LongformTask) -> AsyncIterator[str]:
    """OpenAI's transcription stream: ``transcript.text.delta`` events, one per accepted
    segment, then ``transcript.text.done`` with the full text (= the deltas concatenated)."""
    text = TextStream()
    try:
        async for segment in transcribe_async(state.aengine, task):
            delta = text.push(segment.text)
            if delta:
                yield _event({"type": "transcript.text.delta", "delta": delta, "logprobs": None})
    except RuntimeError as exc:
        yield _event(error_body(500, f"transcription failed: {exc}", None, "engine_error"))
        return
    yield _event({"type": "transcript.text.done", "text": text.text, "logprobs": None,
                  "usage": usage(task.duration)})
