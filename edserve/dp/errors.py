"""Errors of the data-parallel client, already in the HTTP layer's shape."""

from __future__ import annotations

from edserve.server.errors import APIError


class WorkerLost(APIError):
    """The worker running a request died (or was stopped) before the request finished.

    An :class:`~edserve.server.errors.APIError` with status 503 (``worker_lost``,
    ``Retry-After: 1``), so a route that lets it propagate answers a 503 in OpenAI's error
    shape; the request can be retried (the worker is being restarted, the others serve)."""

    def __init__(self, message: str, code: str = "worker_lost") -> None:
        super().__init__(503, message, None, code, {"Retry-After": "1"})
