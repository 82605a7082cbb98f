"""Server-sent events shared by the audio and chat streams.

:func:`sse_response` turns an async iterator of JSON payloads into ``data: {...}`` events. If
the iterator raises, the stream ends with one ``error`` event in OpenAI's shape
(``event: error`` / ``data: {"type": "error", "error": {...}}``; the ``openai`` client raises
it as ``APIError``) instead of a cut connection; chat streams then still end with
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from edserve.engine.errors import RequestFailed
from edserve.server.errors import error_body

logger = logging.getLogger("edserve.server")


def sse_data(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(status: int, message: str, code: str | None) -> str:
    return f"event: error\n{sse_data({'type': 'error', **error_body(status, message, None, code)})}"


async def _events(source: AsyncIterator[Any], what: str, done: bool) -> AsyncIterator[str]:
    try:
        async for payload in source:
            yield sse_data(payload)
    except asyncio.CancelledError:
        raise
    except (RequestFailed, RuntimeError) as exc:  # RuntimeError: longform.feed (for now)
        yield sse_error(500, f"{what} failed: {exc}", "engine_error")
    except Exception:
        logger.exception("%s stream failed", what)
        yield sse_error(500, f"{what} failed: internal server error", "server_error")
    if done:
        yield "data: [DONE]\n\n"


def sse_response(source: AsyncIterator[Any], what: str, done: bool = False) -> StreamingResponse:
    """A ``text/event-stream`` of ``source``'s payloads; ``what`` names the work in error
    messages ("transcription", "generation"); ``done``: end with ``data: [DONE]``."""
    return StreamingResponse(_events(source, what, done), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
