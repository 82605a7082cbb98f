"""Reject request bodies larger than a limit with 413, before they are parsed or stored.

A declared ``Content-Length`` over the limit is answered at once; a chunked body is counted as
it arrives. Either way the rest of the body is read and discarded first (up to ``drain_cap``
bytes), so the client, still sending, gets the 413 instead of a reset connection.
"""

from __future__ import annotations

from typing import Any

from edserve.server.errors import send_error

Scope = dict[str, Any]


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Pure ASGI middleware; ``max_bytes`` bounds the whole body (file + form fields).
    ``limit_label`` is the limit as users configured it ("25 MiB"), for the error text."""

    def __init__(self, app: Any, max_bytes: int, limit_label: str,
                 drain_cap: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.limit_label = limit_label
        self.drain_cap = drain_cap if drain_cap is not None else 8 * max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(receive, send, 0)
            return
        seen = 0
        started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await self._reject(receive, send, seen)

    async def _reject(self, receive: Any, send: Any, seen: int) -> None:
        more = True
        while more and seen <= self.drain_cap:
            message = await receive()
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send_error(send, 413, f"request body exceeds the {self.limit_label} upload limit",
                         "file", "file_too_large", close=True)
