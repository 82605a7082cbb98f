"""Errors the engine front ends raise to their callers."""

from __future__ import annotations


class RequestFailed(RuntimeError):
    """An engine request ended without a usable result: it failed (engine error) or was
    aborted (client gone, shutdown). ``rid`` names the request when known.

    A ``RuntimeError`` subclass, so callers that still catch ``RuntimeError`` keep working.
    """

    def __init__(self, message: str, rid: str | None = None) -> None:
        super().__init__(message)
        self.rid = rid
