"""What a :class:`~edserve.dp.client.DataParallelClient` knows of the model without holding
it: the facts its workers report once they have loaded their engines
(:class:`~edserve.dp.protocol.WorkerFacts`), as the
:class:`~edserve.engine.protocol.EngineClient` properties (a mixin of the client)."""

from __future__ import annotations

from typing import Any

from edserve.config import EngineConfig
from edserve.dp import protocol as P
from edserve.dp.router import WorkerState
from edserve.dp.supervisor import Supervisor
from edserve.models.mllama.inputs import MllamaFacts


class WorkerFactsView:
    """The model facts of the first worker that reported (a restarted worker reports anew)."""

    supervisor: Supervisor
    _config: EngineConfig  # the settings every worker was started with
    _resolved_config: tuple[P.WorkerFacts, EngineConfig] | None

    @property
    def workers(self) -> list[WorkerState]:
        return self.supervisor.workers

    @property
    def _facts(self) -> P.WorkerFacts:
        for w in self.workers:
            if w.facts is not None:
                return w.facts
        raise RuntimeError("no data-parallel worker has started")

    # ---- model facts ------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._facts.tokenizer

    @property
    def model(self) -> Any:
        """The model's facts without weights: for Mllama what chat requests are prepared
        with (:class:`~edserve.models.mllama.inputs.MllamaFacts`), else only ``config``
        (:class:`~edserve.dp.protocol.ModelFacts`)."""
        if self._facts.is_mllama:
            return MllamaFacts(self._facts.model_config)
        return P.ModelFacts(self._facts.model_config)

    @property
    def config(self) -> EngineConfig:
        """The workers' settings, with the running limit they resolved."""
        facts = self._facts
        cached = self._resolved_config
        if cached is None or cached[0] is not facts:  # new facts: a (re)started worker
            cached = self._resolved_config = (
                facts, self._config.replace(max_running_requests=facts.max_running_requests))
        return cached[1]

    @property
    def max_decoder_len(self) -> int:
        return self._facts.max_decoder_len

    @property
    def device_type(self) -> str:
        return self._facts.device.split(":")[0]

    @property
    def is_mllama(self) -> bool:
        return self._facts.is_mllama
