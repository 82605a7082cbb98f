"""The FastAPI app: OpenAI-compatible audio endpoints plus models, health, metrics.

``create_app(aengine, config)`` builds an app around a running
:class:`~edserve.engine.async_engine.AsyncEngine`; all per-request state lives in the handlers
(the app only holds the engine, the config and the metrics registry).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from edserve.server.body_limit import BodyLimitMiddleware
from edserve.server.chat import require_audio_model
from edserve.server.chat import router as chat_router
from edserve.server.config import ServerConfig
from edserve.server.errors import APIError, api_error_handler, http_error_handler
from edserve.server.metrics import ServerMetrics, StatusCounterMiddleware
from edserve.server.params import parse_form
from edserve.server.transcription import run

FORM_OVERHEAD = 1024 * 1024  # multipart framing + text fields on top of the file


def _check_auth(request: Request) -> None:
    key = request.app.state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                       None, "invalid_api_key")


def _check_model(request: Request, model: str) -> None:
    cfg: ServerConfig = request.app.state.config
    if model not in (cfg.served_model_name, "whisper-1"):
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{cfg.served_model_name}'", "model", "model_not_found")


async def _audio_endpoint(request: Request, task: str) -> Response:
    _check_auth(request)
    require_audio_model(request)
    cfg: ServerConfig = request.app.state.config
    try:
        form = await request.form(max_files=4, max_fields=64, max_part_size=FORM_OVERHEAD)
    except StarletteHTTPException as exc:
        raise APIError(400, f"malformed multipart body: {exc.detail}") from None
    try:
        params = await parse_form(form, cfg.max_upload_bytes)
    finally:
        await form.close()
    _check_model(request, params.model)
    return await run(request, params, task)


def _integrity(aengine: Any) -> dict[str, Any]:
    """On the engine thread: the KV integrity check plus what is held right now."""
    engine = aengine.engine
    engine.check_integrity()
    alloc = engine.pools.allocator
    return {"ok": True, "kv_slots_used": alloc.size - alloc.available_size(),
            "kv_slots_total": alloc.size, "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting), "inflight": aengine.num_inflight}


def create_app(aengine: Any, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="edserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aengine = aengine
    app.state.config = config
    app.state.metrics = metrics = ServerMetrics(aengine)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_upload_bytes + FORM_OVERHEAD)

    app.add_middleware(StatusCounterMiddleware, counter=metrics.requests)
    app.include_router(chat_router)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _audio_endpoint(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _audio_endpoint(request, "translate")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_auth(request)
        card = {"id": config.served_model_name, "object": "model", "created": 0,
                "owned_by": "edserve"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = aengine.is_alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    if config.enable_debug_endpoints:
        @app.get("/debug/integrity")
        async def integrity() -> JSONResponse:
            try:
                report = await aengine.call(lambda: _integrity(aengine))
            except Exception as exc:
                raise APIError(500, f"integrity check failed: {exc}", None,
                               "integrity_error") from None
            return JSONResponse(report)

    return app
