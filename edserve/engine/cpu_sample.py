"""Which sampling plans a compiled CPU decode step samples inside its own graph.

The CPU counterpart of :mod:`edserve.engine.sample_graphs`: after the compiled decoder
(:mod:`edserve.engine.cpu_compile`) a step sampled eagerly: the logits filters, the greedy
choice, the log-probabilities, the token-history append and beam rows' top-k, ~40 small ops
whose dispatch cost ~0.33 ms of a ~3 ms int8 tiny.en step on a 2-core Xeon (wave 30). A plan
that the CUDA sampling graphs could capture (:func:`~edserve.engine.sample_graphs.graph_key`:
greedy rows, one chain of capturable filters, beam rows' top-k at most) is now sampled by
:func:`~edserve.engine.sampler.sample` inside the compiled decode graph, one graph per
(bucket, sampling key); a second graph call per step (another dynamo frame) cost ~0.09 ms.

:class:`SamplingKeys` keeps one plan per key for those graphs: the first step of a key runs
eagerly, decoder and sampling (it builds the filters' cached tensors that the graph then reads;
:meth:`~edserve.engine.cpu_compile.CompiledDecodeRunner.can_run` asks), later steps get the
kept plan, whose beam top-k rows are a static index this step's rows are copied into. Anything
else is sampled eagerly after a graph without sampling, with the same result.
"""

from __future__ import annotations

from dataclasses import replace

from edserve.engine.sample_graphs import MAX_GRAPHS, candidate_key, graph_key
from edserve.engine.sampler import SamplingPlan


class SamplingKeys:
    """The sampling plans compiled decode graphs sample with, by key (at most ``max_keys``;
    later keys sample eagerly)."""

    def __init__(self, max_keys: int = MAX_GRAPHS) -> None:
        self.max_keys = max_keys
        self.seen: set[tuple] = set()  # keys sampled eagerly once
        self.plans: dict[tuple, SamplingPlan] = {}  # key -> the plan its graphs read

    @staticmethod
    def key(plan: SamplingPlan, rows: int) -> tuple | None:
        """The key of a graph sampling ``plan`` over ``rows`` padded rows; None: no graph
        takes ``plan`` (temperature, best_of's draws, filters with host effects)."""
        chain = graph_key(plan)
        return None if chain is None else (rows, chain, candidate_key(plan))

    def first_step(self, plan: SamplingPlan, rows: int) -> bool:
        """Whether this is the first step of ``plan``'s key, which the caller samples (and
        runs) eagerly; it counts as that step (the next one gets a kept plan)."""
        key = self.key(plan, rows)
        if key is None or key in self.seen or len(self.plans) >= self.max_keys:
            return False
        self.seen.add(key)
        return True

    def plan_for(self, plan: SamplingPlan, rows: int) -> tuple[tuple, SamplingPlan] | None:
        """``(key, kept plan)`` for sampling ``plan`` over ``rows`` padded rows in a graph, this
        step's beam rows copied into the kept plan's static index; None: the caller samples
        eagerly (a plan no graph takes, a key whose first step has not run, or past
        ``max_keys``)."""
        key = self.key(plan, rows)
        if key is None:
            return None
        kept = self.plans.get(key)
        if kept is None:
            if key not in self.seen or len(self.plans) >= self.max_keys:
                return None
            kept = self.plans[key] = _own_copy(plan)
        if kept.candidates is not None:  # the beam rows move between steps
            kept.candidates.topk_rows.copy_(plan.candidates.topk_rows)
        return key, kept


def _own_copy(plan: SamplingPlan) -> SamplingPlan:
    """``plan`` with its top-k rows (if any) in a tensor of its own (the graph's static index)."""
    if plan.candidates is None:
        return plan
    return replace(plan, candidates=replace(plan.candidates,
                                            topk_rows=plan.candidates.topk_rows.clone()))
