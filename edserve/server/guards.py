"""Request guards: Origin/Host checks (cross-origin and DNS-rebinding), a body read timeout,
a rate limiter, and the pending-audio memory budget.

All are small and self-contained; the app wires them in ``app.py``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import threading
import time
from typing import Any

from edserve.server.errors import APIError, send_error

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (where rebinding attacks matter)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The host part of a ``Host`` header value (``[::1]:8000`` -> ``[::1]``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class OriginHostMiddleware:
    """403 for a request whose ``Origin`` is not in ``origins`` (``"*"`` allows any), and,
    when the server is bound to a loopback ``bind_host``, for a ``Host`` header other than
    ``localhost``, ``127.0.0.1``, ``[::1]`` or the bound host (any port): a page on another
    site, or a rebound DNS name, cannot drive a local server."""

    def __init__(self, app: Any, origins: tuple[str, ...], bind_host: str) -> None:
        self.app = app
        self.origins = origins
        self.any_origin = "*" in origins
        self.hosts = None
        if is_loopback(bind_host):
            bound = bind_host.lower()
            bound = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
            self.hosts = {*LOOPBACK_HOSTS, bound}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if self.hosts is not None and host is not None \
                and _host_name(host.decode("latin-1")) not in self.hosts:
            await send_error(send, 403, "this server only answers requests addressed to "
                             "localhost (Host header refused)", None, "host_not_allowed")
            return
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin \
                and origin.decode("latin-1").strip().rstrip("/").lower() not in self.origins:
            await send_error(send, 403, "cross-origin requests from this origin are not "
                             "allowed (see --allowed-origins)", None, "origin_not_allowed")
            return
        await self.app(scope, receive, send)


class _BodyTimeout(Exception):
    pass


async def _within(awaitable: Any, seconds: float) -> Any:
    """``await awaitable``, or ``asyncio.TimeoutError`` after ``seconds``. Python >= 3.11:
    ``asyncio.timeout`` (a timer on the current task: ~7 us) rather than ``wait_for`` (a new
    task per call: ~18 us), which matters once per body chunk of every upload."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


class BodyTimeoutMiddleware:
    """408 (and close) when a request body stalls: each ``receive()`` of a body chunk must
    arrive within ``timeout`` seconds. Once the body is complete, ``receive()`` (waiting for
    a disconnect) is not timed."""

    def __init__(self, app: Any, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        started = False

        async def timed_receive() -> dict[str, Any]:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await _within(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise _BodyTimeout from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracking_send)
        except _BodyTimeout:
            if started:
                raise
            await send_error(send, 408, f"the request body stalled for more than "
                             f"{self.timeout:g} s", None, "request_timeout", close=True)


class RateLimiter:
    """Token bucket: ``rate`` requests per second, bursts of ``max(1, rate)``."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def check(self) -> None:
        """Take one token or raise APIError 429 with ``Retry-After``."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return
            wait = (1.0 - self.tokens) / self.rate if self.rate > 0 else 60.0
        raise APIError(429, "too many debug requests; slow down", None, "rate_limit_exceeded",
                       {"Retry-After": str(max(1, math.ceil(wait)))})


class PendingBudget:
    """Bytes of uploaded audio held by requests not yet handed to the engine (being read,
    decoded or turned into features). :meth:`reserve` waits (at most ``wait`` s, FIFO-ish:
    every release wakes the waiters) while ``nbytes`` more would exceed the budget, then
    raises APIError 503 (``Retry-After``); one request alone is always admitted.
    :meth:`release` returns bytes and wakes the waiters. Event-loop only.

    A burst of uploads larger than the budget (16 concurrent 10-minute WAVs: 293 MiB against
    the default 256) therefore queues instead of failing: a waiting request's upload sits in
    its spooled temporary file (on disk beyond 1 MiB), not in the budgeted memory."""

    def __init__(self, limit: int, wait: float = 0.0) -> None:
        self.limit = limit
        self.wait = wait
        self.held = 0
        self._waiters: list[asyncio.Future[None]] = []

    def _fits(self, nbytes: int) -> bool:
        return not self.held or self.held + nbytes <= self.limit

    async def reserve(self, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while not self._fits(nbytes):
            left = deadline - loop.time()
            if left <= 0:
                raise APIError(503, "the server is busy decoding other uploads; retry shortly",
                               None, "server_busy", {"Retry-After": "2"})
            woken = loop.create_future()
            self._waiters.append(woken)
            try:
                await asyncio.wait_for(woken, left)
            except asyncio.TimeoutError:
                pass
            finally:
                if woken in self._waiters:
                    self._waiters.remove(woken)
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes
        if nbytes:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
