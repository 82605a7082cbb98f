""":class:`DataParallelClient`: the :class:`~edserve.engine.protocol.EngineClient` surface over
N engine worker processes, so ``create_app`` and every route work unchanged.

Requests must pickle (prompt ids, the log-mel tensor, sampling params and the batched logits
filters and a ``readout``, e.g. word timestamps' alignment, all do); a request with an
``on_finished_kv`` callback (it would run in the worker) is refused with
:class:`~edserve.engine.errors.RequestFailed`. A ``keep_encoder`` handle is an id valid on the
worker that made it: a request passing it as ``encoder_kv`` runs there, its encoder input left
behind (not sent), or re-encodes that input when that worker has restarted since
(:mod:`edserve.dp.handles`; one without an encoder input fails with
:class:`~edserve.dp.errors.WorkerLost` then). A request whose worker dies fails with
:class:`~edserve.dp.errors.WorkerLost` (503). Also used with one worker
(``--engine-process``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
from collections.abc import AsyncIterator
from typing import Any

from edserve.audio.held_mel import MelWindowRef
from edserve.audio.prepare import DecodedAudio, PreparedAudio
from edserve.config import EngineConfig
from edserve.dp import placement as placement_mod
from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.dp.client_facts import WorkerFactsView
from edserve.dp.errors import WorkerLost
from edserve.dp.handles import id_view
from edserve.dp.mel_store import BUDGET_ENV
from edserve.dp.router import pick
from edserve.dp.supervisor import Supervisor
from edserve.engine.errors import RequestFailed
from edserve.engine.outputs import GenerateOutput, TokenDelta
from edserve.engine.protocol import EngineClient, EngineStats
from edserve.engine.request import FinishReason, GenerateRequest
from edserve.engine.step_stats import sum_steps

CALL_TIMEOUT_S = 60.0
logger = logging.getLogger("edserve.dp")


class DataParallelClient(WorkerFactsView, EngineClient):
    """``DataParallelClient(config, n).start()``; :meth:`shutdown` drains and stops workers.

    ``config``: the engine settings of every worker (placed by
    :func:`edserve.dp.placement.plan`: one GPU each, or a share of the CPU cores).
    ``held_mel_bytes``: how much of long uploads' log-mels each worker keeps (default: its
    environment's ``EDSERVE_HELD_MEL_BYTES``, else 4 GiB; :mod:`edserve.dp.mel_store`).
    """

    def __init__(self, config: EngineConfig, size: int, model_name: str = "",
                 log_level: str = "WARNING", gpus: list[str] | None = None,
                 held_mel_bytes: int | None = None) -> None:
        self._config = config
        self.size = size
        self.model_name = model_name
        placements = placement_mod.plan(config, size, gpus)
        if held_mel_bytes is not None:  # each worker's MelStore budget (dp/mel_store.py)
            for p in placements:
                p.env[BUDGET_ENV] = str(held_mel_bytes)
        self.supervisor = Supervisor(placements, log_level)
        self._resolved_config: tuple[P.WorkerFacts, EngineConfig] | None = None

    def start(self, timeout: float = 600.0) -> DataParallelClient:
        """Start the workers; returns once every one has loaded its engine."""
        self.supervisor.start(timeout)
        return self

    @property
    def supports_kv_hooks(self) -> bool:
        return False  # the KV lives in the workers: no on_finished_kv callbacks

    @property
    def supports_encoder_handles(self) -> bool:
        return True  # ids of the worker that holds the region (dp/handles.py)

    # ---- stats ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The sum of the ready workers' latest snapshots."""
        snaps = [w.stats for w in self.workers if w.ready and w.stats is not None]
        total = {k: sum(getattr(s, k) for s in snaps) for k in
                 ("waiting", "running", "kv_used", "kv_free", "kv_total", "generated_tokens")}
        return EngineStats(**total, taken_at=min((s.taken_at for s in snaps),
                                                 default=time.monotonic()),
                           steps=sum_steps([s.steps for s in snaps]))

    @property
    def num_inflight(self) -> int:
        return len(self.supervisor.pending)

    # ---- requests -----------------------------------------------------------------------
    @staticmethod
    def _encoded(request: GenerateRequest, stream: bool) -> list:
        """The request's frames (:func:`edserve.dp.wire.encode`), or ValueError now when it
        cannot be pickled."""
        if request.on_finished_kv is not None:
            raise RequestFailed("word timestamps (and other on_finished_kv hooks) are not "
                                "supported with engine worker processes", request.rid)
        try:
            return wire.encode(P.Generate(request, stream))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ValueError(f"request {request.rid} cannot be sent to a worker process: "
                             f"{exc}") from None

    def _route(self, request: GenerateRequest) -> tuple[GenerateRequest, int | None]:
        """The request as sent and the worker it must run on (None: any). The caller holds
        the supervisor's lock (no restart in between).

        ``encoder_kv`` whose worker still serves the incarnation that made it: the request
        runs there, with the worker's id, and goes WITHOUT its ``encoder_input`` (the worker's
        engine takes the encoder extent from the handle): the region is all it reads, so a
        window's log-mel or PCM (0.35-1.5 MB) is neither pickled, sent nor validated again
        for a fallback retry. The input stays on the caller's request because only here is it
        known whether the handle will do: when its worker restarted since (or is not serving)
        the handle is dropped and the request re-encodes that input on any worker, so a
        caller that keeps its input (Whisper's fallback) never sees a restart; one that sent
        none (a chat's sibling choices) fails with :class:`WorkerLost` (it has nothing to
        encode). So an input that travels with a live handle is not checked against it
        either (the engine does that in process): pass a handle only with its own input.

        A window of a held log-mel (:class:`~edserve.audio.held_mel.MelWindowRef`) that is
        encoded runs on the worker holding the log-mel (:class:`WorkerLost` when that worker
        restarted since). ValueError for an unknown handle or log-mel."""
        held = request.encoder_kv
        if held is not None:
            ref = self.supervisor.handles.get(held)
            if self._generation(ref.worker) == ref.generation:
                return dataclasses.replace(request, encoder_kv=id_view(held, ref.worker_id),
                                           encoder_input=None), ref.worker
            if request.encoder_input is None:
                raise WorkerLost(f"encoder handle {held.id}: engine worker {ref.worker} "
                                 "restarted and its encoder K/V went with it; the request "
                                 "carries no encoder input to encode again")
            logger.info("encoder handle %d: worker %d restarted, its KV is gone; re-encoding",
                        held.id, ref.worker)
            request = dataclasses.replace(request, encoder_kv=None)
        if isinstance(request.encoder_input, MelWindowRef):
            window, pinned = self.supervisor.mels.route(request.encoder_input, self._generation)
            return dataclasses.replace(request, encoder_input=window), pinned
        return request, None

    def _generation(self, index: int) -> int | None:
        """Worker slot ``index``'s generation while it serves, else None."""
        w = self.workers[index]
        return w.generation if w.ready else None

    async def _deltas(self, request: GenerateRequest, stream: bool) -> AsyncIterator[TokenDelta]:
        with self.supervisor.lock:
            request, worker = self._route(request)
            pending = self.supervisor.submit(request.rid, self._encoded(request, stream), worker)
        finished = False
        try:
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                pending.taken(item)
                yield item
        finally:
            self.supervisor.forget(request.rid, abort=not finished)  # no more adopted after
            for handle in list(pending.handles):  # given out, but nobody took it
                self.release_encoder(handle)

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit to the least-loaded worker (``encoder_kv``: the handle's worker; see
        :meth:`_route`) and yield its deltas (last: ``finished`` with
        ``output``); closing early aborts it there. ``ValueError`` when the worker's engine
        refuses the request, :class:`WorkerLost` (503) when the worker dies."""
        return self._deltas(request, True)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run to completion on one worker (only the final output crosses the socket).
        Raises :class:`RequestFailed` when it failed or was aborted, :class:`WorkerLost` when
        its worker died; cancelling the caller aborts it."""
        out, deltas = None, self._deltas(request, False)
        try:
            async for delta in deltas:
                out = delta.output
        finally:
            await deltas.aclose()
        assert out is not None
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise RequestFailed(out.error or f"request {out.rid} was aborted", out.rid)
        return out

    def abort(self, rid: str) -> None:
        """Cancel a request on its worker (thread-safe)."""
        self.supervisor.forget(rid, abort=True)

    def release_encoder(self, handle: Any) -> None:
        """Hand ``handle`` back to the worker holding it (run between its steps); only logged
        when that worker restarted since (its KV went with the process) or when the handle is
        not held (released twice). TypeError for anything but an EncoderKV."""
        ref = self.supervisor.handles.pop(handle)
        if ref is not None and not self.supervisor.send_to(
                ref.worker, ref.generation, P.ReleaseEncoder(ref.worker_id)):
            logger.info("release_encoder: worker %d restarted (or is stopping); handle %d "
                        "went with its process", ref.worker, handle.id)

    def validate(self, request: GenerateRequest) -> None:
        """The engine's admission checks, run on a worker (blocking; call it off the event
        loop): ``ValueError`` when the request is invalid or could never fit the KV cache."""
        self._encoded(request, False)  # refuses what cannot be sent
        w = pick(self.workers)
        if w is None:
            raise WorkerLost("no engine worker is available (restarting)", "no_worker")
        self.supervisor.call(w, "validate", request).result(CALL_TIMEOUT_S)

    async def features(self, audio: DecodedAudio) -> PreparedAudio:
        """On the least-loaded worker, off its engine loop (:mod:`edserve.dp.features`); the
        log-mel normally stays there (``mel``: a :class:`~edserve.audio.held_mel.HeldMel`
        whose windows run on that worker, released when the caller drops it or calls its
        ``release()``)."""
        w = pick(self.workers)
        if w is None:
            raise WorkerLost("no engine worker is available (restarting)", "no_worker")
        future = asyncio.wrap_future(self.supervisor.call(w, "features", audio))
        return await asyncio.wait_for(future, CALL_TIMEOUT_S)

    async def integrity(self) -> dict[str, Any]:
        """The KV-cache integrity check on every worker; totals plus ``workers`` (one report
        each; a worker that is not ready reports ``ok: False``; ``held_log_mels``: long
        uploads' log-mels the workers keep, 0 when no transcription runs). Raises when one is
        corrupt."""
        futures = [asyncio.wrap_future(self.supervisor.call(w, "integrity"))
                   for w in self.workers]
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True),
                                         CALL_TIMEOUT_S)
        reports = []
        for w, r in zip(self.workers, results, strict=True):
            if isinstance(r, WorkerLost):
                reports.append({"worker": w.index, "ok": False, "status": "not ready"})
            elif isinstance(r, BaseException):
                raise r
            else:
                reports.append({"worker": w.index, **r})
        ok = [r for r in reports if r["ok"]]
        total = {k: sum(r[k] for r in ok) for k in
                 ("kv_slots_used", "kv_slots_total", "running", "waiting", "held_log_mels")}
        return {"ok": len(ok) == len(reports), **total, "inflight": self.num_inflight,
                "workers": reports}

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while at least one worker serves."""
        return not self.supervisor.closing and any(w.ready for w in self.workers)

    def health(self) -> dict[str, Any]:
        """``status``: ``ok`` when every worker serves, ``degraded`` when some do, ``engine
        stopped`` when none does; ``workers``: one entry each."""
        workers = [w.describe() for w in self.workers]
        serving = sum(w["ready"] for w in workers)
        status = "ok" if serving == len(workers) else "degraded" if serving else \
            "engine stopped"
        return {"status": status, "workers": workers}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Drain in-flight requests for at most ``timeout`` s, then stop every worker."""
        self.supervisor.shutdown(timeout)
