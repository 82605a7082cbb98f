"""The sampling of a compiled CPU decode step, compiled too (``--cpu-compile``).

The CPU counterpart of :mod:`edserve.engine.sample_graphs`: after the compiled decoder
(:mod:`edserve.engine.cpu_compile`) a step still sampled eagerly: the logits filters, the greedy
choice, the log-probabilities, the token-history append and beam rows' top-k, ~40 small ops
whose dispatch cost ~0.33 ms of a ~3 ms int8 tiny.en step on a 2-core Xeon (wave 30).
:class:`CompiledSampler` runs that same :func:`~edserve.engine.sampler.sample` as one
``torch.compile`` graph per (padded rows, filter chain, candidate shape), the keys and the
capturable plans of the CUDA sampling graphs (:func:`~edserve.engine.sample_graphs.graph_key`).
Anything else is sampled eagerly, with the same result.

The graph works on all padded rows of the compiled step's logits; padding rows point at
``req_to_token`` row 0, whose history is the token history's padding row. The first step of a
key is sampled eagerly (it also builds the filters' cached tensors, which the graph then reads),
the next one compiles. Each key compiles its own copy of the sampling function's code (dynamo
keeps compiled graphs per code object), so a known key runs its one graph without evaluating
guards on the plan and history objects.
"""

from __future__ import annotations

import logging
import types
from dataclasses import replace

import torch

from edserve.engine.sample_graphs import MAX_GRAPHS, candidate_key, graph_key
from edserve.engine.sampler import SamplingPlan, sample
from edserve.engine.token_history import TokenHistory

logger = logging.getLogger("edserve")


def _sample_rows(logits: torch.Tensor, rows: torch.Tensor, plan: SamplingPlan,
                 history: TokenHistory):
    """:func:`sample` with the per-step tensors first (the compiled function's body)."""
    return sample(logits, plan, history, rows)


class CompiledSampler:
    """Compiled sampling functions of one :class:`CompiledDecodeRunner`, made on a key's second
    use (at most ``max_keys``; later keys sample eagerly)."""

    def __init__(self, backend: str = "inductor", max_keys: int = MAX_GRAPHS) -> None:
        """``backend``: torch.compile's (tests trace with ``"eager"``)."""
        self.compiler, self.max_keys = backend, max_keys
        self.seen: set[tuple] = set()  # keys sampled eagerly once
        # key -> (compiled function, its plan, the static top-k rows [R] or None)
        self.fns: dict[tuple, tuple] = {}
        self.steps = 0  # steps sampled by a compiled function

    def sample(self, plan: SamplingPlan, logits: torch.Tensor, rows: torch.Tensor, bs: int,
               history: TokenHistory
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] \
            | None:
        """Tokens and log-probabilities ([bs] each) of the first ``bs`` of the padded rows of
        ``logits`` ``[padded, V]`` whose ``req_to_token`` rows are ``rows`` ``[padded]``,
        appended to ``history``, and beam rows' candidates (as :func:`sample` returns them);
        None when ``plan`` cannot be compiled (the caller samples eagerly)."""
        chain = graph_key(plan)
        if chain is None:
            return None
        key = (logits.shape[0], chain, candidate_key(plan))
        found = self.fns.get(key)
        if found is None:
            if key in self.seen and len(self.fns) < self.max_keys:
                found = self.fns[key] = self._compile(plan)
            else:
                self.seen.add(key)
                return sample(logits[:bs], plan, history, rows[:bs])
        fn, own_plan, topk_rows = found
        if topk_rows is not None:  # this step's beam rows into the function's static index
            topk_rows.copy_(plan.candidates.topk_rows)
        if key in self.seen:  # its first call traces and compiles (guards evaluated)
            self.seen.discard(key)
            tokens, logprobs, cands = fn(logits, rows, own_plan, history)
            logger.info("compiled the CPU sampling of %d row(s), %d filter(s)",
                        logits.shape[0], len(chain))
        else:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                tokens, logprobs, cands = fn(logits, rows, own_plan, history)
        self.steps += 1
        return tokens[:bs], logprobs[:bs], cands

    def _compile(self, plan: SamplingPlan) -> tuple:
        topk_rows = None
        if plan.candidates is not None:  # top-k rows only (candidate_key): a static index
            topk_rows = plan.candidates.topk_rows.clone()
            plan = replace(plan, candidates=replace(plan.candidates, topk_rows=topk_rows))
        own = types.FunctionType(_sample_rows.__code__.replace(), _sample_rows.__globals__,
                                 "_sample_rows")
        return torch.compile(own, backend=self.compiler, dynamic=False), plan, topk_rows
