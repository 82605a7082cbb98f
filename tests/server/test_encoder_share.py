""":class:`~edserve.server.encoder_share.EncoderShare` on its own (a fake client): choice 0
asks for the handle; a sibling waits for it and goes with the handle and WITHOUT the image
(the engine takes the encoder extent from the handle); when choice 0 ends without a handle
the siblings keep the image; the handle is released once."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import torch

from edserve.engine.request import EncoderKV, GenerateRequest, SamplingParams
from edserve.server.encoder_share import EncoderShare

IMAGE = torch.zeros(1, 4, 3, 8, 8)  # [images, tiles, channels, H, W] stand-in pixels


def _setup(n: int = 3):
    released: list = []
    client = SimpleNamespace(supports_encoder_handles=True, release_encoder=released.append)
    request = GenerateRequest([128, 1, 15], IMAGE, SamplingParams(temperature=1.0, seed=4),
                              cross_kv_ranges=[(0, 17)] * 3)
    return EncoderShare(client, request, n), request, released


def _same_but(got: GenerateRequest, want: GenerateRequest, **changed) -> None:
    """``got`` is ``want`` with ``changed`` fields only."""
    for f in dataclasses.fields(GenerateRequest):
        expected = changed.get(f.name, getattr(want, f.name))
        assert getattr(got, f.name) is expected or getattr(got, f.name) == expected, f.name


def test_siblings_go_with_the_handle_and_without_the_image():
    async def run():
        share, request, released = _setup()
        first = await share.request_for(0, request)
        _same_but(first, request, share_encoder=True)
        assert first.encoder_input is IMAGE
        waiting = [asyncio.ensure_future(share.request_for(i, request)) for i in (1, 2)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)  # no handle yet
        handle = EncoderKV(torch.empty(0, dtype=torch.long), 17, 32)
        share.offer(0, SimpleNamespace(encoder_kv=handle))
        for sibling in await asyncio.gather(*waiting):
            _same_but(sibling, request, encoder_kv=handle, encoder_input=None)
        assert share.handle is handle and released == []
        share.close()
        share.close()
        assert released == [handle] and share.handle is None

    asyncio.run(run())


def test_siblings_keep_the_image_when_choice_0_ends_without_a_handle():
    async def run():
        share, request, released = _setup()
        await share.request_for(0, request)
        waiting = asyncio.ensure_future(share.request_for(1, request))
        share.first_ended()
        sibling = await waiting
        assert sibling is request and sibling.encoder_input is IMAGE
        assert sibling.encoder_kv is None
        share.close()
        assert released == []

    asyncio.run(run())


def test_nothing_shared_for_one_choice_or_text_only():
    async def run():
        share, request, _ = _setup(n=1)
        assert not share.active and await share.request_for(0, request) is request
        text = dataclasses.replace(request, encoder_input=None, cross_kv_ranges=None)
        share = EncoderShare(SimpleNamespace(supports_encoder_handles=True), text, 2)
        assert not share.active and await share.request_for(1, text) is text

    asyncio.run(run())
