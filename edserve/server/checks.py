"""Checks shared by the routes: API key, model name, the served model's kind, JSON bodies."""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import Request

from edserve.server.errors import APIError

MAX_JSON_DEPTH = 32


def check_auth(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer KEY`` (when a key is set)."""
    key = request.app.state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                       None, "invalid_api_key")


def check_model(request: Request, model: str, aliases: tuple[str, ...] = ()) -> None:
    """404 unless ``model`` is the ``--served-model-name`` or one of ``aliases``."""
    served = request.app.state.config.served_model_name
    if model != served and model not in aliases:
        shown = model if len(model) <= 64 else model[:64] + "..."
        raise APIError(404, f"The model '{shown}' does not exist; this server serves "
                       f"'{served}'", "model", "model_not_found")


def require_audio_model(request: Request) -> None:
    """400 when the served model cannot take audio (called by the audio endpoints)."""
    if request.app.state.engine.is_mllama:
        raise APIError(400, "this server serves a Llama-3.2-Vision (Mllama) model, which does "
                       "not take audio; use /v1/chat/completions", "model", "unsupported_task")


def _depth_ok(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True


async def read_json(request: Request, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as JSON; 400 when it is not JSON or nests deeper than ``max_depth``."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        body = None
        deep = True
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    else:
        deep = not _depth_ok(body, max_depth)
    if deep:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels",
                       None, "invalid_value")
    return body


def show(value: Any, limit: int = 40) -> str:
    """A short ``repr`` of a client value for error texts."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
