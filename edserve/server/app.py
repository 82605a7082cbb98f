"""The FastAPI app: OpenAI-compatible audio and chat endpoints plus models, health, metrics.

``create_app(engine, config)`` builds an app around an
:class:`~edserve.engine.protocol.EngineClient` (an ``AsyncEngine`` is wrapped in an
:class:`~edserve.engine.local_client.InProcessClient`); the routes use nothing else of the
engine. All per-request state lives in the handlers.

Middleware, outermost first: status counting + catch-all 500 (:class:`StatusCounterMiddleware`),
Origin/Host checks, CORS for allowed origins, the body read timeout, the body size limit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from edserve.engine.local_client import InProcessClient
from edserve.engine.protocol import EngineClient
from edserve.server.audio_pool import make_preparer
from edserve.server.body_limit import BodyLimitMiddleware
from edserve.server.chat import router as chat_router
from edserve.server.checks import check_auth, check_model, require_audio_model
from edserve.server.config import DEFAULT_MODEL_NAME, ServerConfig
from edserve.server.errors import APIError, api_error_handler, http_error_handler
from edserve.server.feature_policy import FeaturePolicy
from edserve.server.guards import (
    BodyTimeoutMiddleware,
    OriginHostMiddleware,
    PendingBudget,
    RateLimiter,
)
from edserve.server.metrics import ServerMetrics, StatusCounterMiddleware
from edserve.server.multipart import read_form
from edserve.server.openapi import (
    api_version,
    audio_operation,
    install_openapi,
    model_languages,
    models_operation,
    plain_operation,
)
from edserve.server.params import mib_label, parse_form
from edserve.server.transcription import run
from edserve.whisper.language import LanguageGuess

DESCRIPTION = ("OpenAI-compatible speech-to-text (Whisper) and image chat (Llama-3.2-Vision) "
               "served by edserve. Errors: `{\"error\": {message, type, param, code}}`.")
HEALTH_DOC = plain_operation(
    "Liveness: 200 while the engine (or a data-parallel worker) serves, else 503",
    "application/json", {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string", "enum": ["ok", "degraded", "engine stopped"]}}}, 503)
FORM_OVERHEAD = 1024 * 1024  # multipart framing + text fields on top of the file
AUDIO_MODEL_ALIASES = (DEFAULT_MODEL_NAME,)


async def _audio_endpoint(request: Request, task: str) -> Response:
    check_auth(request)
    require_audio_model(request)
    state = request.app.state
    cfg: ServerConfig = state.config
    started = time.perf_counter()
    try:
        form = await read_form(request, max_files=4, max_fields=64, max_part_size=FORM_OVERHEAD)
    except StarletteHTTPException as exc:
        raise APIError(400, f"malformed multipart body: {exc.detail}") from None
    held = 0

    async def reserve(nbytes: int) -> None:
        nonlocal held
        await state.pending.reserve(nbytes)
        held = nbytes

    def release() -> None:
        nonlocal held
        state.pending.release(held)
        held = 0

    try:
        try:
            params = await parse_form(form, cfg.max_upload_mb, reserve)
        finally:
            await form.close()
        check_model(request, params.model, AUDIO_MODEL_ALIASES)
        state.metrics.stage("upload_read", time.perf_counter() - started)
        return await run(request, params, task, on_prepared=release)
    finally:
        release()


def create_app(engine: Any, config: ServerConfig | None = None) -> FastAPI:
    """``engine``: an :class:`EngineClient`, or a started ``AsyncEngine`` to wrap in one."""
    config = config or ServerConfig()
    if config.served_model_name is None:  # launch.build resolves it from the model first
        config = dataclasses.replace(config, served_model_name=DEFAULT_MODEL_NAME)
    client = engine if isinstance(engine, EngineClient) \
        else InProcessClient(engine, config.served_model_name)
    docs = config.openapi_docs
    features = FeaturePolicy(config.device_features_threshold(client.device_type),
                             config.device_features_idle_max(client.device_type),
                             config.step_features_on(client.device_type))
    audio = make_preparer(config.audio_workers, client.n_mels or 80)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        audio.shutdown()  # the workers start with the first upload, or launch.build's start()

    app = FastAPI(title="edserve", version=api_version(), description=DESCRIPTION,
                  docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None, lifespan=lifespan)
    app.state.engine = client
    app.state.audio = audio
    app.state.features = features
    app.state.language_guess = LanguageGuess()  # detecting windows guess the last language
    app.state.config = config
    app.state.metrics = metrics = ServerMetrics(client, app.state.language_guess)
    app.state.pending = PendingBudget(config.max_pending_audio_bytes,
                                      config.pending_wait_seconds)
    debug_limiter = RateLimiter(config.debug_rate_limit)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    # add_middleware prepends: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_upload_bytes + FORM_OVERHEAD,
                       limit_label=mib_label(config.max_upload_mb))
    app.add_middleware(BodyTimeoutMiddleware, timeout=config.body_timeout)
    if config.origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(OriginHostMiddleware, origins=config.origins, bind_host=config.host)
    app.add_middleware(StatusCounterMiddleware, counter=metrics.requests)
    app.include_router(chat_router)

    @app.post("/v1/audio/transcriptions", openapi_extra=audio_operation("transcribe"))
    async def transcriptions(request: Request) -> Response:
        return await _audio_endpoint(request, "transcribe")

    @app.post("/v1/audio/translations", openapi_extra=audio_operation("translate"))
    async def translations(request: Request) -> Response:
        return await _audio_endpoint(request, "translate")

    @app.get("/v1/models", openapi_extra=models_operation())
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        card = {"id": config.served_model_name, "object": "model", "created": 0,
                "owned_by": "edserve"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health", openapi_extra=HEALTH_DOC)
    async def health() -> JSONResponse:
        return JSONResponse(client.health(), status_code=200 if client.is_alive else 503)

    @app.get("/metrics", openapi_extra=plain_operation(
        "Prometheus metrics", "text/plain", {"type": "string"}))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    if config.enable_debug_endpoints:
        @app.get("/debug/integrity", openapi_extra=plain_operation(
            "Run the KV-cache integrity check (tests)", "application/json",
            {"type": "object"}, 401, 429, 500))
        async def integrity(request: Request) -> JSONResponse:
            check_auth(request)
            debug_limiter.check()
            started = time.perf_counter()
            try:
                report = await client.integrity()
            except Exception as exc:
                raise APIError(500, f"integrity check failed: {type(exc).__name__}: {exc}",
                               None, "integrity_error") from None
            report["seconds"] = round(time.perf_counter() - started, 4)
            return JSONResponse(report)

    install_openapi(app, list(dict.fromkeys((config.served_model_name, *AUDIO_MODEL_ALIASES))),
                    config.api_key is not None, model_languages(client.tokenizer))
    return app
