"""The audio endpoints: validated form -> long-form transcription -> OpenAI response or SSE.

Work per request: decode the upload (untrusted: an allow-list of containers, stopped at
``--max-audio-seconds``) and compute the log-mel in an audio worker process (or thread:
:mod:`edserve.server.audio_pool`), then drive one
:class:`~edserve.whisper.longform.LongformTask` through the :class:`EngineClient` (its windows
batch with every other request's). Decode errors are one generic 400 text (no paths). A client
that disconnects cancels the decode and the features, or aborts its engine request (KV freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from edserve.audio.errors import (
    AudioError,
    AudioTooLongError,
    DecodeCancelled,
    EmptyAudioError,
    NonFiniteAudioError,
)
from edserve.audio.prepare import (
    DecodedAudio,
    PreparedAudio,
    decode_long_wav,
    may_hold,
    prepare_samples,
    step_features,
)
from edserve.engine.errors import RequestFailed
from edserve.engine.request import SamplingParams
from edserve.server.audio_pool import AudioWorkerLost
from edserve.server.disconnect import ClientGone, unless_disconnected
from edserve.server.errors import APIError
from edserve.server.metrics import EngineTimes
from edserve.server.params import TranscriptionParams
from edserve.server.sse import sse_response
from edserve.server.text_stream import TextStream
from edserve.server.transcript_logprobs import segment_logprobs, transcript_logprobs
from edserve.whisper.formats import to_srt, to_text, to_vtt, verbose_dict
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions, temperature_schedule
from edserve.whisper.result import Transcription
from edserve.whisper.transcribe import make_task, transcribe_async
from edserve.whisper.usage import TokenUsage

logger = logging.getLogger("edserve.server")
UNDECODABLE = "the uploaded file could not be decoded as audio (corrupt, empty, or not a " \
    "supported audio format)"


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


def decoding(params: TranscriptionParams, cfg: Any, max_rows: int | None = None
             ) -> dict[str, Any]:
    """Beam search / best-of settings of one request: its fields, else the server's
    ``--beam-size`` / ``--best-of``; 400 for combinations the decoder refuses and for more
    beams or samples than the engine has rows (``max_rows``: --max-running-requests)."""
    beam_size = params.beam_size if params.beam_size is not None else cfg.beam_size
    best_of = params.best_of if params.best_of is not None else cfg.best_of
    for name, n in (("beam_size", beam_size), ("best_of", best_of)):
        if max_rows is not None and n > max_rows:
            raise APIError(400, f"'{name}' {n} exceeds the {max_rows} rows this server "
                           "decodes at once (--max-running-requests)", name, "invalid_value")
    if params.patience is not None and beam_size == 1:
        raise APIError(400, "'patience' needs beam search: send 'beam_size' > 1 with it",
                       "patience", "invalid_value")
    try:  # the engine's own rules (e.g. round(beam_size * patience) >= 1)
        SamplingParams(beam_size=beam_size, patience=params.patience,
                       length_penalty=params.length_penalty)
    except ValueError as exc:
        raise APIError(400, f"'patience': {exc}", "patience", "invalid_value") from None
    return dict(beam_size=beam_size, best_of=best_of, patience=params.patience,
                length_penalty=params.length_penalty)


def build_options(params: TranscriptionParams, task: str, cfg: Any, seed: int
                  ) -> TranscribeOptions:
    """The long-form options of one request: timestamps for timed formats or ``segment``,
    word timestamps for ``timestamp_granularities[]=word`` (``words`` in verbose_json), the
    ``mel_padding`` field else the server's ``--mel-padding``."""
    timed = params.response_format in ("srt", "vtt", "verbose_json") \
        or "segment" in params.granularities
    return TranscribeOptions(
        language=params.language, task=task,
        temperatures=temperature_schedule(params.temperature),
        compression_ratio_threshold=cfg.compression_ratio_threshold,
        logprob_threshold=cfg.logprob_threshold, no_speech_threshold=cfg.no_speech_threshold,
        condition_on_previous_text=cfg.condition_on_previous_text,
        initial_prompt=params.prompt, timestamps=True if timed else None, seed=seed,
        word_timestamps="word" in params.granularities,
        mel_padding=params.mel_padding or cfg.mel_padding, **decoding(params, cfg))


def _refusal(exc: BaseException) -> APIError:
    """The 400 for an upload ``prepare_upload`` refused (generic, path-free texts)."""
    if isinstance(exc, AudioTooLongError):
        return APIError(400, f"audio is longer than the {exc.limit:g} s limit", "file",
                        "audio_too_long")
    if isinstance(exc, EmptyAudioError):
        return APIError(400, "the uploaded file holds no audio samples", "file", "empty_audio")
    if isinstance(exc, NonFiniteAudioError):
        return APIError(400, "the audio contains NaN or infinite samples", "file",
                        "invalid_audio")
    return APIError(400, UNDECODABLE, "file", "invalid_audio")


async def prepare(app_state: Any, params: TranscriptionParams, task: str,
                  cancel: threading.Event) -> LongformTask:
    """Decode the upload and compute its log-mel on the app's audio preparer (worker
    processes, or threads: :mod:`edserve.server.audio_pool`; a long upload's log-mel on the
    engine's device, ``--device-features-above-s``), then build the task.
    Cancelling the caller sets ``cancel`` (a thread job stops; a queued job is dropped)."""
    client, cfg, metrics = app_state.engine, app_state.config, app_state.metrics
    check_task(client.tokenizer, task, params.language)
    # refuse bad combinations before the audio is decoded
    decoding(params, cfg, getattr(client.config, "max_running_requests", None))
    options = build_options(params, task, cfg, client.config.seed)
    started = time.perf_counter()
    defer_above_s = app_state.features.defer_above_s()  # feature_policy: host or device
    data = params.audio_bytes
    try:  # only an upload that could hold that many 16-bit samples takes the thread hop
        audio = await asyncio.to_thread(decode_long_wav, data, cfg.max_audio_seconds,
                                        defer_above_s) \
            if defer_above_s is not None and may_hold(data, defer_above_s) else None
        if audio is None:
            audio = await app_state.audio.prepare(data, cfg.max_audio_seconds, cancel,
                                                  defer_above_s)
    except AudioError as exc:
        raise _refusal(exc) from None
    except AudioWorkerLost:
        raise APIError(503, "an audio worker process stopped while decoding this upload; "
                       "retry", "file", "audio_worker_lost", {"Retry-After": "1"}) from None
    except BaseException:
        cancel.set()
        raise
    if isinstance(audio, DecodedAudio):  # a short clip's log-mel in the prefill step, or
        step = step_features(audio, client.n_mels or 80) if app_state.features.in_step \
            else None
        audio = step or await _device_features(client, audio)  # the device's, beside it
    waited = time.perf_counter() - started - audio.decode_s - audio.features_s
    metrics.stage("audio_wait", max(0.0, waited))
    metrics.stage("audio_decode", audio.decode_s)
    metrics.stage("features", audio.features_s)
    if cancel.is_set():
        raise DecodeCancelled("client gone")
    return make_task(client, audio, options, "upload", app_state.language_guess)


async def _device_features(client: Any, audio: DecodedAudio) -> PreparedAudio:
    """The log-mel of a long upload from the engine's device; when that fails (e.g. out of
    device memory) from the host, in a thread, with a warning."""
    try:
        return await client.features(audio)
    except (RuntimeError, TimeoutError) as exc:
        logger.warning("log-mel on the engine's device failed (%s); computing it on the host",
                       exc)
    n_mels = client.n_mels or 80
    prepared = await asyncio.to_thread(prepare_samples, audio.float_samples(), n_mels)
    return dataclasses.replace(prepared, decode_s=audio.decode_s)


def usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def render(result: Transcription, params: TranscriptionParams, task: str,
           tokenizer: Any = None) -> Response:
    """The response body of ``params.response_format``; json with ``include[]=logprobs``
    (``params.logprobs``) also ``logprobs`` (:mod:`.transcript_logprobs`; needs the model's
    ``tokenizer``)."""
    fmt = params.response_format
    if fmt == "json":
        logprobs = {"logprobs": transcript_logprobs(tokenizer, result.segments)} \
            if params.logprobs else {}
        return JSONResponse({"text": result.text, **logprobs, "usage": usage(result.duration)})
    if fmt == "verbose_json":
        return JSONResponse({**verbose_dict(result, task), "usage": usage(result.duration)})
    body = {"text": to_text, "srt": to_srt, "vtt": to_vtt}[fmt](result)
    return PlainTextResponse(body)


async def _collect(client: Any, task: LongformTask, times: EngineTimes) -> Transcription:
    async for _ in transcribe_async(client, task, times.add):
        pass
    return task.result()


async def run(request: Request, params: TranscriptionParams, task_name: str,
              on_prepared: Any = None) -> Response:
    """Transcribe and render; a client that goes away cancels the decode, the features and
    the engine work. ``on_prepared()`` runs once the upload is no longer held for decoding."""
    with request.app.state.features.track():  # in flight: see feature_policy
        return await _run(request, params, task_name, on_prepared)


async def _run(request: Request, params: TranscriptionParams, task_name: str,
               on_prepared: Any) -> Response:
    state = request.app.state
    start = time.perf_counter()
    cancel = threading.Event()
    try:
        task = await unless_disconnected(request, prepare(state, params, task_name, cancel))
    except (ClientGone, DecodeCancelled):
        return Response(status_code=499)  # the client is gone; nobody reads this
    finally:
        if on_prepared is not None:
            on_prepared()
    if params.stream:
        return sse_response(_sse(state, task, params.logprobs), "transcription")
    times = EngineTimes()
    try:
        result = await unless_disconnected(request, _collect(state.engine, task, times))
    except ClientGone:
        return Response(status_code=499)
    except (RequestFailed, RuntimeError) as exc:  # RuntimeError: LongformTask.feed (for now)
        raise APIError(500, f"transcription failed: {exc}", None, "engine_error") from None
    finally:
        task.release()  # a log-mel held by an engine worker, on every way out
    times.observe(state.metrics)
    rendered = time.perf_counter()
    response = render(result, params, task_name, state.engine.tokenizer)
    state.metrics.stage("response", time.perf_counter() - rendered)
    state.metrics.latency.labels(task_name).observe(time.perf_counter() - start)
    state.metrics.audio_seconds.inc(result.duration)
    return response


async def _sse(state: Any, task: LongformTask, logprobs: bool = False
               ) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's transcription stream: ``transcript.text.delta`` events, one per accepted
    segment, then ``transcript.text.done`` with the full text (= the deltas concatenated)
    and token usage. With ``logprobs`` (``include[]=logprobs``) each delta carries the
    entries of its segment's text tokens and the done event all of them, so the deltas'
    lists concatenate to the done event's list, which is the non-streamed response's."""
    text, tokens, times = TextStream(), TokenUsage(), EngineTimes()
    tokenizer = state.engine.tokenizer
    entries: list[dict[str, Any]] = []  # every segment's, in order
    sent = 0  # entries[:sent] went out on a delta

    def seen(req: Any, out: Any) -> None:
        tokens.add(req, out)
        times.add(req, out)

    try:
        async for segment in transcribe_async(state.engine, task, seen):
            if logprobs:
                entries += segment_logprobs(tokenizer, segment)
            delta = text.push(segment.text)
            if delta:  # always, for a kept segment (it has text); else its entries wait
                event = {"type": "transcript.text.delta", "delta": delta}
                if logprobs:
                    event["logprobs"], sent = entries[sent:], len(entries)
                yield event
    finally:
        task.release()
    times.observe(state.metrics)
    if logprobs and sent < len(entries):  # (not reached: see above) no entry goes unsent
        yield {"type": "transcript.text.delta", "delta": "", "logprobs": entries[sent:]}
    done = {"type": "transcript.text.done", "text": text.text}
    if logprobs:
        done["logprobs"] = entries
    yield {**done, "usage": tokens.openai()}
