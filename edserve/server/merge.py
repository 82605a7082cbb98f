"""Interleave several async iterators into one, items in the order they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

_END = object()


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Every item of every source as soon as it is ready. An exception in a source is raised
    here (the others are cancelled); when the consumer stops early (a client gone), every
    source is cancelled and closed, so their ``finally`` blocks (engine aborts) run."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((_END, None))
        except Exception as exc:  # handed to the consumer
            await queue.put((_END, exc))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in sources:
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                await aclose()
