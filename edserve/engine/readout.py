"""What the engine computes for a caller from a finished request's KV, asked for by a request
field and returned in the output (no callback into the caller's process).

``GenerateRequest.readout`` holds a small picklable object with ``read(kv, model) -> Any``;
the engine runs it on its own thread at a normal finish (``STOP``/``LENGTH``), while the
request's KV is still allocated (``kv``: :class:`~edserve.engine.request.FinishedKV`; ``model``:
the engine's model), and puts the result in ``GenerateOutput.readout``. Because only the
description crosses to the engine, it works the same whether the engine runs on a thread of
the caller's process or in an engine worker process (word timestamps:
:class:`~edserve.whisper.cross_weights.AlignmentReadout`). A readout that raises fails its
request (as an ``on_finished_kv`` hook does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from edserve.engine.outputs import TokenDelta
from edserve.engine.request import FinishedKV, GenerateRequest


class KVReadout(Protocol):
    def read(self, kv: FinishedKV, model: Any) -> Any:
        """The result for ``GenerateOutput.readout`` (engine thread; ``kv`` is freed after)."""


def attach(request: GenerateRequest, model: Any,
           on_delta: Callable[[TokenDelta], None] | None
           ) -> tuple[GenerateRequest, Callable[[TokenDelta], None] | None]:
    """The request to schedule and the delivery to use: unchanged without a readout, else a
    copy whose ``on_finished_kv`` runs the readout and a delivery that puts its result on the
    final output. ValueError when the request also carries its own ``on_finished_kv``."""
    readout = request.readout
    if readout is None:
        return request, on_delta
    if request.on_finished_kv is not None:
        raise ValueError("a request takes either a readout or an on_finished_kv hook, not both")
    if not callable(getattr(readout, "read", None)):
        raise ValueError(f"readout must have a read(kv, model) method, got "
                         f"{type(readout).__name__}")
    result: list[Any] = []

    def run(kv: FinishedKV) -> None:
        result.append(readout.read(kv, model))

    def deliver(delta: TokenDelta) -> None:
        if delta.finished and delta.output is not None and result:
            delta.output.readout = result[0]
        if on_delta is not None:
            on_delta(delta)

    return dataclasses.replace(request, on_finished_kv=run), deliver
