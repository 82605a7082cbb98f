"""The narrow engine interface the HTTP layer uses: :class:`EngineClient`.

The server never touches the scheduler, the KV pools or the engine thread directly: it submits
requests (:meth:`EngineClient.generate` / :meth:`EngineClient.stream`), aborts them, dry-runs
their validation, reads a stats snapshot, runs the integrity check, and reads model facts. The
snapshot is rebuilt on the engine thread after every step (cheap reads only), so ``/metrics``
and health checks cost the engine nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from edserve.engine.async_engine import AsyncEngine
from edserve.engine.core import EngineStats
from edserve.engine.errors import RequestFailed
from edserve.engine.request import FinishReason, GenerateOutput, GenerateRequest, TokenDelta

__all__ = ["EngineClient", "EngineStats", "RequestFailed"]


class EngineClient:
    """What the HTTP layer may do with the engine (see the module doc).

    ``model_name``: the name the server reports (``--served-model-name``).
    """

    # The engine runs in this process, so requests may carry callbacks that read the KV
    # (``on_finished_kv``: word timestamps). Clients of remote engines say False.
    supports_kv_hooks = True

    def __init__(self, aengine: AsyncEngine, model_name: str = "") -> None:
        self._aengine = aengine
        self._engine = aengine.engine
        self._core = aengine.core
        self.model_name = model_name
        self._stats = self._core.stats()  # startup read; afterwards only on the engine thread
        aengine.add_step_hook(self._refresh)

    # ---- stats ------------------------------------------------------------------------
    def _refresh(self) -> None:  # engine thread, after each step
        self._stats = self._core.stats()

    def stats(self) -> EngineStats:
        """The latest snapshot (refreshed once per engine step; never waits)."""
        return self._stats

    @property
    def num_inflight(self) -> int:
        """Requests submitted through this process's AsyncEngine and not finished yet."""
        return self._aengine.num_inflight

    # ---- requests -----------------------------------------------------------------------
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit and yield deltas (last: ``finished`` with ``output``); closing early aborts.
        ``ValueError`` before the first delta when the engine refuses the request."""
        return self._aengine.stream(request)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run to completion. Raises :class:`RequestFailed` when the request failed or was
        aborted; cancelling the caller aborts it (KV freed)."""
        out = await self._aengine.generate(request)
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise RequestFailed(out.error or f"request {out.rid} was aborted", out.rid)
        return out

    def abort(self, rid: str) -> None:
        """Cancel a request (thread-safe); its row and KV are freed at the next step."""
        self._core.abort(rid)

    def release_encoder(self, handle: Any) -> None:
        """Hand back a ``keep_encoder`` handle from an output (thread-safe; carried out on the
        engine thread before any engine call submitted after it)."""
        self._aengine.call_soon(lambda: self._engine.scheduler.release_encoder(handle))

    def validate(self, request: GenerateRequest) -> None:
        """Dry run of the engine's admission checks (any thread): ``ValueError`` when the
        request is invalid or could never fit the KV cache, even when it is empty."""
        self._core.validate(request)

    async def integrity(self) -> dict[str, Any]:
        """Run the KV-cache integrity check on the engine thread (one call per step at most);
        returns the stats at that moment plus ``ok`` and ``inflight``. Raises on corruption."""
        return await self._aengine.call(self._core.integrity)

    # ---- model facts ------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model(self) -> Any:
        """The model object, for request preprocessing only (image tiles, mel bins)."""
        return self._engine.model

    @property
    def config(self) -> Any:
        """The engine's (frozen) configuration."""
        return self._engine.config

    @property
    def max_decoder_len(self) -> int:
        return self._engine.max_decoder_len

    @property
    def is_mllama(self) -> bool:
        return getattr(self.model, "model_type", None) == "mllama"

    @property
    def is_multilingual(self) -> bool:
        return bool(getattr(self.tokenizer, "is_multilingual", False))

    @property
    def n_mels(self) -> int | None:
        """Mel bins of a Whisper model (None for other models)."""
        return getattr(self.model.config, "num_mel_bins", None)

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._aengine.is_alive

    def shutdown(self, timeout: float = 10.0) -> None:
        self._aengine.shutdown(timeout)
