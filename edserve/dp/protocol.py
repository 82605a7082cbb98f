"""Messages between the API process and its engine workers (ZeroMQ, pickled tuples).

Sockets (all ``ipc://`` endpoints in a private temporary folder; the API process binds):

- ``up``: one PULL in the API process; every worker connects a PUSH and sends
  ``(kind, worker, ...)`` tuples: :data:`HELLO` ``(facts)`` once its engine is loaded (or
  :data:`FAILED` ``(message)`` when it cannot start),
  :data:`DELTA` ``(rid, TokenDelta)`` (every token of a streamed request, else only the last),
  :data:`REJECT` ``(rid, message)`` when the engine refuses a request (ValueError),
  :data:`STATS` ``(EngineStats)`` at most every ``STATS_INTERVAL_S`` while busy and once when
  idle, :data:`REPLY` ``(call_id, ok, value)`` for a call, :data:`BYE` ``()`` on exit.
- ``down-<worker>-<generation>``: one PUSH per worker incarnation in the API process (a
  restarted worker gets a fresh endpoint, so nothing meant for its predecessor reaches it);
  the worker's PULL receives :data:`GEN` ``(GenerateRequest, stream)``, :data:`ABORT`
  ``(rid)``, :data:`CALL` ``(call_id, name, arg)`` (``integrity``, ``validate``) and
  :data:`STOP` ``(drain_timeout)``.

Pickle is used between processes of one host started by the same user (never across a
network boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HELLO, FAILED, DELTA, REJECT = "hello", "failed", "delta", "reject"
STATS, REPLY, BYE = "stats", "reply", "bye"
GEN, ABORT, CALL, STOP = "gen", "abort", "call", "stop"
STATS_INTERVAL_S = 0.05


@dataclass(frozen=True)
class WorkerFacts:
    """What the API process needs to prepare requests without a model of its own: the
    tokenizer, the model's config (mel bins, ...), the decoder length, the worker's resolved
    engine settings. Sent once per worker start."""

    pid: int
    tokenizer: Any
    model_config: Any
    max_decoder_len: int
    is_mllama: bool
    device: str
    threads: int | None
    max_running_requests: int  # the worker's resolved running limit


class ModelFacts:
    """Stands in for ``EngineClient.model`` in the API process: only ``config`` is there
    (request preprocessing reads the mel bins from it); the weights live in the workers."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the model lives in the data-parallel workers; {name!r} is not "
                             "available in the API process")
