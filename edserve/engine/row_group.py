"""Row groups: one request decoded on several ``req_to_token`` rows that share its KV.

Beam search (:mod:`edserve.engine.beam_search`) and best_of sampling
(:mod:`edserve.engine.best_of`) are :class:`RowGroup` strategies. The scheduler admits a group
as one request (its *leader* row prefills the encoder and the prompt once); after every step it
hands the group its rows' results, and the group rearranges its rows through
:class:`GroupOps`:

- ``advance(row, token)``: a row goes on with a new token (it keeps its row and KV);
- ``fork(source, token)``: a new row starts from a source row's KV plus a new token: it shares
  every page of the source (encoder region included) and copies only the partial last page on
  its first write (copy-on-write, :mod:`edserve.mem_cache.fork`), so reordering beams never
  copies KV beyond one page per fork;
- ``drop(row)``: a row leaves the group (its pages lose one reference); groups drop before they
  fork, so a rearrangement never holds more pages than the rows it ends with.

Groups are host-side policy objects (no tensors): they see tokens and log-probabilities and
decide; the scheduler owns rows and pages. A group knows its rows only as :class:`Row` (a
``serial``), so this module sits below :mod:`edserve.engine.req` (whose ``Req`` is the row the
scheduler hands in) and imports nothing of it.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch

from edserve.engine.request import EncoderKV

_group_ids = itertools.count()


class Row(Protocol):
    """What a group needs of one of its rows: a serial, unique per row (the scheduler's
    :class:`~edserve.engine.req.Req`)."""

    serial: int


@dataclass
class Hypothesis:
    """One row's sequence so far (host): generated tokens and their log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sum_logprob: float = 0.0

    def extended(self, token: int, logprob: float) -> Hypothesis:
        return Hypothesis(self.tokens + [token], self.logprobs + [logprob],
                          self.sum_logprob + logprob)


@dataclass
class Finished:
    """A completed sequence: tokens without the stop token; ``stop_logprob`` is the stop
    token's log-probability (None when the sequence ended by length)."""

    tokens: list[int]
    logprobs: list[float]
    sum_logprob: float  # includes stop_logprob
    stop_logprob: float | None


class GroupOps(Protocol):
    """Row operations a group asks of the scheduler (see the module doc)."""

    def advance(self, req: Row, token: int) -> None: ...

    def fork(self, source: Row, token: int,
             generator: torch.Generator | None = None) -> Row:
        """A new row continuing ``source`` with ``token``; it draws from ``generator`` (its own
        random stream; None: greedy rows, or the device's default stream)."""

    def drop(self, req: Row) -> None: ...


@dataclass(frozen=True)
class Candidates:
    """What the sampler must return for a row at a step, besides its sampled token."""

    topk: int = 0  # the k most likely tokens and their log-probabilities (beam search)
    draws: int = 0  # this many independent samples at the row's temperature (best_of)


def rank_score(length: int, sum_logprob: float, length_penalty: float | None) -> float:
    """openai-whisper's MaximumLikelihoodRanker: sum log-prob / penalty, where the penalty is
    the length (``None``) or ``((5 + length) / 6) ** length_penalty`` (Google NMT)."""
    penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
    return sum_logprob / penalty if penalty else sum_logprob


def length_penalty_score(f: Finished, length_penalty: float | None) -> float:
    """:func:`rank_score` of a finished sequence."""
    return rank_score(len(f.tokens), f.sum_logprob, length_penalty)


def best(finished: list[Finished], length_penalty: float | None) -> Finished:
    """The highest-ranked sequence (first one on ties, as ``np.argmax``)."""
    scores = [length_penalty_score(f, length_penalty) for f in finished]
    return finished[scores.index(max(scores))]


class RowGroup(ABC):
    """A request decoded on several rows. ``leader`` is the admitted row (it carries the
    request's callbacks; None once the group has reported, so that a finished leader and its
    group are no reference cycle); ``members`` are the rows alive now (the leader among them
    until it is dropped). ``id`` names the group (a counter: unique for the process's lifetime)."""

    on_device = False  # chosen on the host by update(); DeviceBeamGroup: by DeviceBeams

    def __init__(self, leader: Row, size: int, stop_ids: frozenset[int],
                 length_penalty: float | None) -> None:
        self.id = next(_group_ids)
        self.leader: Row | None = leader
        self.size = size  # most rows alive at once
        self.stop_ids = stop_ids
        self.length_penalty = length_penalty
        self.members: list[Row] = [leader]
        self.hyps: dict[int, Hypothesis] = {leader.serial: Hypothesis()}
        self.finished: list[Finished] = []
        self.hold: EncoderKV | None = None  # the group's reference on its encoder region
        # Row k's random stream (best_of; see groups.row_seed); empty for greedy groups.
        self.generators: list[torch.Generator | None] = []

    @abstractmethod
    def candidates(self, req: Row, first_step: bool) -> Candidates:
        """What ``req``'s row needs from the sampler at this step."""

    @abstractmethod
    def update(self, results: dict[int, StepResult], at_limit: bool, ops: GroupOps) -> bool:
        """Take one step's results (per member ``serial``) and rearrange the rows through
        ``ops``; True when the group is done (then every row has been dropped).
        ``at_limit``: no further step is allowed (length limit)."""

    def result(self) -> Finished:
        """The chosen sequence, once done."""
        return best(self.finished, self.length_penalty)

    def _drop_all(self, ops: GroupOps) -> None:
        for m in self.members:
            ops.drop(m)
        self.members, self.hyps = [], {}


@dataclass(frozen=True)
class StepResult:
    """One row's output at a step: the sampled token, its log-probability, and the
    candidates the group asked for (best first for top-k; in draw order for draws)."""

    token: int
    logprob: float
    candidates: list[tuple[int, float]]
