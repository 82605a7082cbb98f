"""``merge``: items interleaved as they come; an error surfaces; leaving early closes all."""

from __future__ import annotations

import asyncio

import pytest

from edserve.server.merge import merge


async def _gen(name: str, delays: list[float], closed: list[str], fail: bool = False):
    try:
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            yield f"{name}{i}"
        if fail:
            raise ValueError(f"{name} failed")
    finally:
        closed.append(name)


def test_interleaves_by_arrival_and_closes_all():
    closed: list[str] = []

    async def run():
        return [x async for x in merge([_gen("a", [0.0, 0.05], closed),
                                        _gen("b", [0.02, 0.0, 0.0], closed)])]

    assert asyncio.run(run()) == ["a0", "b0", "b1", "b2", "a1"]
    assert sorted(closed) == ["a", "b"]


def test_error_in_one_source_is_raised_and_the_others_closed():
    closed: list[str] = []

    async def run():
        return [x async for x in merge([_gen("a", [0.0], closed, fail=True),
                                        _gen("b", [10.0], closed)])]

    with pytest.raises(ValueError, match="a failed"):
        asyncio.run(run())
    assert sorted(closed) == ["a", "b"]


def test_leaving_early_cancels_the_sources():
    closed: list[str] = []

    async def run():
        m = merge([_gen("a", [0.0, 10.0], closed), _gen("b", [10.0], closed)])
        first = await m.__anext__()
        await m.aclose()
        return first

    assert asyncio.run(run()) == "a0" and sorted(closed) == ["a", "b"]


def test_all_cancels_the_rest_when_one_fails():
    from edserve.server.chat import _all

    closed: list[str] = []

    async def slow():
        try:
            await asyncio.sleep(10)
        finally:
            closed.append("slow")

    async def fails():
        await asyncio.sleep(0.01)
        raise RuntimeError("engine failed")

    async def ok():
        return 1

    assert asyncio.run(_all([ok(), ok()])) == [1, 1]
    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(_all([slow(), fails()]))
    assert closed == ["slow"]
