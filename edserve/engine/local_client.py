""":class:`InProcessClient`: the :class:`~edserve.engine.protocol.EngineClient` over an
:class:`~edserve.engine.async_engine.AsyncEngine` in this process.

The stats snapshot is rebuilt on the engine thread after every step (cheap reads only), so
``/metrics`` and health checks cost the engine nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch

from edserve.audio.device_mel import device_features
from edserve.audio.prepare import DecodedAudio, PreparedAudio
from edserve.engine.async_engine import AsyncEngine
from edserve.engine.core import EngineStats
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.protocol import EngineClient
from edserve.engine.request import FinishReason, GenerateRequest


class InProcessClient(EngineClient):
    """``InProcessClient(AsyncEngine(engine).start(), model_name)``."""

    def __init__(self, aengine: AsyncEngine, model_name: str = "") -> None:
        self._aengine = aengine
        self._engine = aengine.engine
        self._core = aengine.core
        self.model_name = model_name
        self._stats = self._core.stats()  # startup read; afterwards only on the engine thread
        self._features_stream: torch.cuda.Stream | None = None
        aengine.add_step_hook(self._refresh)

    @property
    def supports_kv_hooks(self) -> bool:
        return True  # the engine (and its KV) lives in this process

    # ---- stats ------------------------------------------------------------------------
    def _refresh(self) -> None:  # engine thread, after each step
        self._stats = self._core.stats()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_inflight(self) -> int:
        return self._aengine.num_inflight

    # ---- requests -----------------------------------------------------------------------
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self._aengine.stream(request)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await self._aengine.generate(request)
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise RequestFailed(out.error or f"request {out.rid} was aborted", out.rid)
        return out

    def abort(self, rid: str) -> None:
        self._core.abort(rid)

    def release_encoder(self, handle: Any) -> None:
        """Carried out on the engine thread before any engine call submitted after it."""
        self._aengine.call_soon(lambda: self._engine.scheduler.release_encoder(handle))

    def validate(self, request: GenerateRequest) -> None:
        self._core.validate(request)

    async def features(self, audio: DecodedAudio) -> PreparedAudio:
        """On a thread; on CUDA on a stream of its own (the engine thread's steps go on)."""
        device = self._engine.device
        if device.type == "cuda" and self._features_stream is None:
            self._features_stream = torch.cuda.Stream(device)
        return await asyncio.to_thread(device_features, audio, self.n_mels or 80, device,
                                       self._features_stream)

    async def integrity(self) -> dict[str, Any]:
        """Runs on the engine thread (one call per step at most)."""
        return await self._aengine.call(self._core.integrity)

    # ---- model facts ------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model(self) -> Any:
        return self._engine.model

    @property
    def config(self) -> Any:
        return self._engine.config

    @property
    def max_decoder_len(self) -> int:
        return self._engine.max_decoder_len

    @property
    def device_type(self) -> str:
        return self._engine.device.type

    @property
    def is_mllama(self) -> bool:
        return self._engine.is_mllama

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._aengine.is_alive

    def health(self) -> dict[str, Any]:
        return {"status": "ok" if self.is_alive else "engine stopped"}

    def shutdown(self, timeout: float = 10.0) -> None:
        self._aengine.shutdown(timeout)
