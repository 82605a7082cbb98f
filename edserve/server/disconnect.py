"""Run a request's engine work, cancelling it (and so aborting the engine request, which frees
its KV) if the HTTP client disconnects first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the work finished; the work was cancelled."""


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; raise :class:`ClientGone` (after cancelling it) if the client leaves."""
    job: asyncio.Future[Any] = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for fut in (job, watch):
            if not fut.done():
                fut.cancel()
    if not job.done() or job.cancelled():
        await asyncio.gather(job, return_exceptions=True)  # let the abort run
        raise ClientGone
    return job.result()
