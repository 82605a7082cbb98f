"""One encoder run for the ``n`` choices of a chat completion with an image (as vLLM shares a
prompt's work across parallel samples): :class:`EncoderShare`.

Who holds what, who releases:

- choice 0 is submitted with ``share_encoder`` (:meth:`EncoderShare.request_for`): once its
  prefill has run the vision tower and written the cross-attention K/V, the engine takes a hold
  on that encoder region and hands it over in choice 0's first delta; the choice's stream
  passes every delta through :meth:`EncoderShare.offer`, and from then on the handle is this
  object's (the engine client releases one in a delta that never reached the stream);
- choices 1..n-1 wait for it in :meth:`EncoderShare.request_for` and run with
  ``encoder_kv=handle`` and no ``encoder_input``: no vision run, the same tokens as an encode
  of their own (the engine reads the same K/V and takes the encoder extent from the handle),
  and the image's pixels (up to 4 tiles x 3 x 560 x 560 floats) are neither sent again to an
  engine worker process nor validated again. When choice 0 ends without handing one over
  (refused, failed or aborted before its prefill: :meth:`EncoderShare.first_ended`), their
  wait ends and they keep the image and encode for themselves as independent requests would
  (the completion still fails with choice 0's error; nothing waits forever);
- the completion calls :meth:`EncoderShare.close` once every choice's stream is closed (its
  ``finally``, so on success, failure, abort and a client gone alike): the handle is released
  there, exactly once. A sibling's stream is closed (its engine request finished or aborted)
  before that release, so no request still queued for the region outlives it.

Text-only completions, ``n`` = 1 and clients without encoder handles share nothing (every
method passes the requests through).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from edserve.engine.request import GenerateRequest


class EncoderShare:
    """The encoder handle one completion's choices share (see the module doc)."""

    def __init__(self, client: Any, request: GenerateRequest, n: int) -> None:
        self._client = client
        self.active = n > 1 and request.encoder_input is not None \
            and client.supports_encoder_handles
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._handle: Any = None
        self._closed = False

    async def request_for(self, index: int, request: GenerateRequest) -> GenerateRequest:
        """Choice ``index``'s request as submitted: choice 0 asks for the handle, the others
        wait for it (or for choice 0's end without one: then they keep the image and encode
        it themselves) and reuse it, without the image."""
        if not self.active:
            return request
        if index == 0:
            return dataclasses.replace(request, share_encoder=True)
        handle = await asyncio.shield(self._ready)  # one sibling cancelled: not the others
        if handle is None:
            return request
        return dataclasses.replace(request, encoder_kv=handle, encoder_input=None)

    def offer(self, index: int, delta: Any) -> None:
        """A delta of choice ``index``; choice 0's first one carries the handle (ours now)."""
        handle = getattr(delta, "encoder_kv", None)
        if handle is None:
            return
        if index != 0 or self._closed or self._ready.done():  # not asked for: never kept
            self._client.release_encoder(handle)
            return
        self._handle = handle
        self._ready.set_result(handle)

    def first_ended(self) -> None:
        """Choice 0's stream is closed: the siblings stop waiting (None: no handle came)."""
        if not self._ready.done():
            self._ready.set_result(None)

    def close(self) -> None:
        """Every choice's stream is closed: release the handle (once; later calls no-op)."""
        self._closed = True
        self.first_ended()
        handle, self._handle = self._handle, None
        if handle is not None:
            self._client.release_encoder(handle)

    @property
    def handle(self) -> Any:
        """The handle held now (None before choice 0's first delta and after :meth:`close`)."""
        return self._handle
