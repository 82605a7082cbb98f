"""Connection hygiene for uvicorn: request-head timeout, a connection cap with idle eviction,
an open-file-aware cap, and rate-limited logging of accept errors.

:class:`GuardedH11Protocol` (uvicorn's h11 protocol plus two rules):

* a connection must deliver a complete request head within ``header_timeout`` seconds of
  opening (or of its previous response), else it is closed: silent sockets and slow-header
  clients cannot pin a file descriptor;
* when more than ``max_connections`` are open, the connections with no request in progress
  (oldest first) are closed, so a flood of idle sockets cannot lock out ``/health``.

uvicorn's own ``limit_concurrency`` (503 beyond it) and ``timeout_keep_alive`` still apply.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from edserve.server.config import HTTP_IMPLS

try:  # the C parser (uvicorn's "httptools" implementation): less CPU per request than h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed
    HttpToolsProtocol = None

FD_RESERVE = 48  # descriptors kept free for the engine, uploads spooled to disk, logging


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to fit the open-file limit (minus what is open now and
    :data:`FD_RESERVE`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    return max(8, min(max_connections, soft - open_now - FD_RESERVE))


class ConnectionGuard:
    """The module doc's two rules, mixed into one of uvicorn's protocol classes (which provide
    ``cycle``, ``connections``, ``transport`` and ``loop``); see :func:`guarded_protocol`."""

    header_timeout: float = 10.0
    max_connections: int = 512

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._arm_head_timer()
        if len(self.connections) >= self.max_connections:
            self._evict_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = time.monotonic()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        started = self.cycle is not None and not self.cycle.response_complete
        if not started and not self.transport.is_closing():
            self.transport.close()  # no complete request head in time

    def _evict_idle(self) -> None:
        """Close idle connections (oldest first) until one below the cap; the newest (this
        one) is closed only when no other is idle."""
        idle = sorted((c for c in self.connections
                       if isinstance(c, ConnectionGuard) and not c._busy()
                       and not c.transport.is_closing()),
                      key=lambda c: (c is self, c._idle_since))
        excess = len(self.connections) - self.max_connections + 1
        for conn in idle[:max(0, excess)]:
            conn.transport.close()
            self.connections.discard(conn)


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """h11 (pure Python) with the guard."""


GuardedHttpToolsProtocol = None if HttpToolsProtocol is None else \
    type("GuardedHttpToolsProtocol", (ConnectionGuard, HttpToolsProtocol),
         {"__doc__": "httptools (C) with the guard."})


def guarded_protocol(header_timeout: float, max_connections: int,
                     http: str = "auto") -> type[ConnectionGuard]:
    """A guarded protocol class with these limits (pass as uvicorn's ``http``): ``http``
    ``httptools``, ``h11`` or ``auto`` (httptools when installed). ``ValueError`` for another
    name or for httptools when it is missing."""
    if http not in HTTP_IMPLS:
        raise ValueError(f"--http must be one of {HTTP_IMPLS}, got {http!r}")
    if http == "httptools" and GuardedHttpToolsProtocol is None:
        raise ValueError("--http httptools: the httptools package is not installed "
                         "(pip install httptools)")
    use_c = http == "httptools" or (http == "auto" and GuardedHttpToolsProtocol is not None)
    base = GuardedHttpToolsProtocol if use_c else GuardedH11Protocol
    return type(base.__name__, (base,),
                {"header_timeout": header_timeout, "max_connections": max_connections})


class RateLimitFilter(logging.Filter):
    """Let a record whose message starts with one of ``prefixes`` through at most once per
    ``interval`` seconds per prefix; the next one that passes says how many were dropped."""

    def __init__(self, prefixes: tuple[str, ...], interval: float = 60.0) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.interval = interval
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        key = next((p for p in self.prefixes if message.startswith(p)), None)
        if key is None:
            return True
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{message} ({dropped} more like this in the last " \
                         f"{self.interval:g} s were not logged)"
            record.args = ()
        record.exc_info = None  # one line: the traceback is the same every time
        return True


ACCEPT_ERRORS = ("socket.accept() out of system resource", "Exceeded concurrency limit")


def install_log_limits(interval: float = 60.0) -> None:
    """Rate-limit accept errors (asyncio logs one per failed accept, about one per second
    while descriptors are exhausted) and uvicorn's per-request concurrency-limit warning."""
    for name in ("asyncio", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in log.filters):
            log.addFilter(RateLimitFilter(ACCEPT_ERRORS, interval))
