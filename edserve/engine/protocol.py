"""The narrow engine interface the HTTP layer uses: the abstract :class:`EngineClient`.

The server never touches the scheduler, the KV pools or the engine thread directly: it submits
requests (:meth:`EngineClient.generate` / :meth:`EngineClient.stream`), aborts them, dry-runs
their validation, reads a stats snapshot, runs the integrity check, asks for its health, and
reads model facts. Two clients implement all of it, each with its own ``__init__`` (nothing is
inherited by accident): :class:`~edserve.engine.local_client.InProcessClient` (the engine on a
thread of this process) and :class:`~edserve.dp.client.DataParallelClient` (N >= 1 engine
worker processes). Both drive their engines through one
:class:`~edserve.engine.core.EngineCore`, so the rules behind every method are the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from edserve.audio.prepare import DecodedAudio, PreparedAudio
from edserve.engine.core import EngineStats
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.request import GenerateRequest

__all__ = ["EngineClient", "EngineStats", "RequestFailed"]


class EngineClient(ABC):
    """What the HTTP layer may do with the engine (see the module doc). Implementations set
    ``model_name`` (the name the server reports, ``--served-model-name``) in ``__init__``."""

    model_name: str

    @property
    @abstractmethod
    def supports_kv_hooks(self) -> bool:
        """True when the engine runs in this process, so requests may carry callbacks that
        read the KV (``on_finished_kv``). A ``readout`` (word timestamps) works with every
        client."""

    @property
    def supports_encoder_handles(self) -> bool:
        """True when requests may ask for ``keep_encoder`` handles and pass them back as
        ``encoder_kv`` (encoder reuse across temperature fallback)."""
        return self.supports_kv_hooks

    # ---- stats ------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> EngineStats:
        """The latest snapshot (refreshed once per engine step; never waits)."""

    @property
    @abstractmethod
    def num_inflight(self) -> int:
        """Requests submitted through this client and not finished yet."""

    # ---- requests -----------------------------------------------------------------------
    @abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit and yield deltas (last: ``finished`` with ``output``); closing early aborts.
        ``ValueError`` before the first delta when the engine refuses the request."""

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run to completion. Raises :class:`RequestFailed` when the request failed or was
        aborted; cancelling the caller aborts it (KV freed)."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Cancel a request (thread-safe); its row and KV are freed at the next step."""

    @abstractmethod
    def release_encoder(self, handle: Any) -> None:
        """Hand back a ``keep_encoder`` handle from an output (thread-safe)."""

    @abstractmethod
    def validate(self, request: GenerateRequest) -> None:
        """Dry run of the engine's admission checks (blocking; call it off the event loop):
        ``ValueError`` when the request is invalid or could never fit the KV cache."""

    @abstractmethod
    async def features(self, audio: DecodedAudio) -> PreparedAudio:
        """``audio``'s long-form log-mel computed on the engine's device, off its step loop
        (:func:`~edserve.audio.device_mel.device_features`): for uploads too long to give
        an audio worker's CPU. RuntimeError when it fails (the caller may compute it on the
        host instead)."""

    @abstractmethod
    async def integrity(self) -> dict[str, Any]:
        """The KV-cache integrity check between steps: ``ok``, ``kv_slots_used``,
        ``kv_slots_total``, ``running``, ``waiting``, ``inflight``. Raises on corruption."""

    # ---- model facts ------------------------------------------------------------------
    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def model(self) -> Any:
        """The model, for request preprocessing only (image tiles, mel bins): at least
        ``model.config``."""

    @property
    @abstractmethod
    def config(self) -> Any:
        """The engine's (frozen) configuration, with its resolved running limit."""

    @property
    @abstractmethod
    def max_decoder_len(self) -> int: ...

    @property
    @abstractmethod
    def device_type(self) -> str:
        """Where the engine runs: ``cuda`` or ``cpu``."""

    @property
    @abstractmethod
    def is_mllama(self) -> bool: ...

    @property
    def is_multilingual(self) -> bool:
        return bool(getattr(self.tokenizer, "is_multilingual", False))

    @property
    def n_mels(self) -> int | None:
        """Mel bins of a Whisper model (None for other models)."""
        return getattr(self.model.config, "num_mel_bins", None)

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    @abstractmethod
    def is_alive(self) -> bool:
        """True while requests can be served (``/health`` answers 200, else 503)."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """The ``/health`` body: ``status`` (``ok``, ``degraded`` or ``engine stopped``) and
        whatever else the client reports (e.g. one entry per worker)."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine(s): the data-parallel client first lets in-flight requests finish
        for at most ``timeout`` s; the in-process one stops after the current step."""
