"""Messages between the API process and its engine workers: one frozen dataclass per kind.

Sockets (all ``ipc://`` endpoints in a private temporary folder; the API process binds):

- ``up``: one PULL in the API process; every worker connects a PUSH and sends, each stamped
  with its ``worker`` index: :class:`Hello` once its engine is loaded (or :class:`Failed` when
  it cannot start), :class:`Delta` (every token of a streamed request, else only the last),
  :class:`Reject` when the engine refuses a request (ValueError), :class:`Stats` at most every
  ``STATS_INTERVAL_S`` while busy and once a second when idle, :class:`Reply` for a
  :class:`Call`, :class:`Bye` on exit.
- ``down-<worker>-<generation>``: one PUSH per worker incarnation in the API process (a
  restarted worker gets a fresh endpoint, so nothing meant for its predecessor reaches it);
  the worker's PULL receives :class:`Generate`, :class:`Abort`, :class:`ReleaseEncoder`,
  :class:`ReleaseMel`, :class:`Call` (``integrity``, ``validate``, ``encoder``) and :class:`Stop`.

Each side dispatches by the message's type through a table (:func:`dispatch`). Messages are
pickled (:mod:`edserve.dp.wire`: host tensors as numpy arrays) between processes of one host
started by the same user (never across a network boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

STATS_INTERVAL_S = 0.05


# ---- API process -> worker ------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    """Run ``request`` (a :class:`~edserve.engine.request.GenerateRequest`); ``stream``: send
    every token's delta, else only the final one."""

    request: Any
    stream: bool


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class ReleaseEncoder:
    """Hand back the worker's ``keep_encoder`` handle ``handle_id`` (see
    :mod:`edserve.dp.handles`); run between two steps."""

    handle_id: int


@dataclass(frozen=True)
class ReleaseMel:
    """Drop the worker's held log-mel ``mel_id`` (see :mod:`edserve.audio.held_mel`)."""

    mel_id: int


@dataclass(frozen=True)
class Call:
    """Run the engine-side call ``name`` (``integrity``, ``validate``, ``encoder``) on
    ``arg`` between two steps; answered by a :class:`Reply` with the same ``call_id``."""

    call_id: int
    name: str
    arg: Any = None


@dataclass(frozen=True)
class Stop:
    """Finish in-flight requests within ``drain_timeout`` s, abort the rest, exit."""

    drain_timeout: float


# ---- worker -> API process ------------------------------------------------------------------
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


@dataclass(frozen=True)
class Hello:
    worker: int
    facts: WorkerFacts


@dataclass(frozen=True)
class Failed:
    """The worker could not build its engine (it exits next)."""

    worker: int
    message: str


@dataclass(frozen=True)
class Delta:
    worker: int
    rid: str
    delta: Any  # TokenDelta; the last one has ``finished`` and ``output``


@dataclass(frozen=True)
class Reject:
    """The engine refused the request (its ValueError's text)."""

    worker: int
    rid: str
    message: str


@dataclass(frozen=True)
class Stats:
    worker: int
    stats: Any  # EngineStats


@dataclass(frozen=True)
class Reply:
    """The answer to :class:`Call` ``call_id``: ``value`` when ``ok``, else the exception's
    type name in ``error_type`` and its text in ``value``."""

    worker: int
    call_id: int
    ok: bool
    value: Any
    error_type: str = ""


@dataclass(frozen=True)
class Bye:
    worker: int


def dispatch(table: Mapping[type, Callable[[Any], None]], msg: Any) -> None:
    """Call ``table[type(msg)](msg)``; TypeError for anything that is not a known message."""
    handler = table.get(type(msg))
    if handler is None:
        raise TypeError(f"unexpected message {type(msg).__name__}")
    handler(msg)


class ModelFacts:
    """Stands in for ``EngineClient.model`` in the API process: only ``config`` is there
    (request preprocessing reads the mel bins from it); the weights live in the workers."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the model lives in the engine worker processes; {name!r} is "
                             "not available in the API process")
