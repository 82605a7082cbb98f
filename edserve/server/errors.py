"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

4xx answers have type ``invalid_request_error``, 5xx ``server_error``. :func:`error_response`
builds the JSON response (with ``WWW-Authenticate`` on 401 and any extra headers such as
``Retry-After``); :func:`error_event` the same body as one SSE ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body with ``status`` (and ``headers``,
    e.g. ``Retry-After`` on 429/503)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def error_json(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param, code)).encode()


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers={**extra, **(headers or {})} or None)


async def send_error(send: Any, status: int, message: str, param: str | None = None,
                     code: str | None = None, headers: list[tuple[bytes, bytes]] = (),
                     close: bool = False) -> None:
    """Send a complete OpenAI-shaped JSON error from pure ASGI middleware."""
    body = error_json(status, message, param, code)
    head = [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail))
