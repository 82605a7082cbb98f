"""The sampling of a graph-replayed decode step, replayed as a CUDA graph of its own.

After the decoder's graph, a step still launched its sampling eagerly: the logits filters
(openai-whisper's timestamp grammar alone is ~35 small ops), the greedy choice, the
log-probabilities and the token-history append: ~55 launches whose host cost (~1.4 ms per step
on the H200's host at 64 rows) left the device idle between steps. :class:`SampleGraphs`
captures that work once per (padded batch size, filter chain) and replays it, so a steady
decode step launches two graphs.

What a graph can capture (:func:`graph_key`): every row greedy (no temperature; row-group
candidates only as beam groups' top-k, whose batch positions the graph reads from a static
index: :func:`candidate_key`), one filter chain for the whole batch (or none), and only filters
that declare ``capturable = True`` (pure tensor ops, no host state: a recorder is not).
Anything else is sampled eagerly by :func:`~edserve.engine.sampler.sample`, with the same
result.

The graph works on all ``padded`` rows of the decode graph's output; the padding rows point at
``req_to_token`` row 0, which no request holds, so their history appends land in the token
history's padding row (:meth:`TokenHistory.append` keeps that row's length bounded even
when it is listed many times). The first step of a key is sampled eagerly (which also builds
the filters' cached device tensors that the capture then bakes in) and the graph is captured
right after it, on a side stream.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from edserve.engine.graph_capture import capture
from edserve.engine.sampler import SamplingPlan, sample
from edserve.engine.token_history import TokenHistory

logger = logging.getLogger("edserve")

#: Sampling graphs kept per runner: (batch sizes) x (filter chains in use) stays far below it
#: unless requests keep bringing new filter settings; those then sample eagerly.
MAX_GRAPHS = 256


def candidate_key(plan: SamplingPlan) -> tuple[int, int] | tuple[()] | None:
    """``()``: no row-group candidates; ``(R, k)``: the top-k of ``R`` rows only (beam
    groups: capturable, the rows' positions copied into the graph's static index); None:
    draws (best_of's seeded generators), which stay eager."""
    c = plan.candidates
    if c is None:
        return ()
    if c.draw_rows is not None or c.topk_rows is None:
        return None
    return c.topk_rows.numel(), c.topk


def graph_key(plan: SamplingPlan) -> tuple | None:
    """The filter chain a captured graph can replay for ``plan`` (``()``: no filters), or None
    when ``plan`` must be sampled eagerly."""
    if plan.sampled is not None or candidate_key(plan) is None:
        return None
    if not plan.groups:
        return ()
    if len(plan.groups) != 1 or plan.groups[0].rows is not None:
        return None
    chain = plan.groups[0].filters
    if not all(getattr(f, "capturable", False) for f in chain):
        return None
    return chain


class SampleGraphs:
    """Sampling graphs of one decode-graph runner, captured on first use per key.

    ``pool``: the memory pool of the decode graphs (graphs that never run at the same time may
    share one; every graph's outputs stay referenced here, so no capture reuses them)."""

    def __init__(self, device: torch.device, pool=None, max_graphs: int = MAX_GRAPHS) -> None:
        self.device = device
        self.pool = pool
        self.max_graphs = max_graphs  # past it, new keys are sampled eagerly (bounded memory)
        # (padded, chain, candidate_key) -> (graph, tokens [padded], logprobs [padded],
        #   candidates ([R*k] tokens, [R*k] log-probs) or None, static top-k rows [R] or None)
        self.graphs: dict[tuple, tuple] = {}
        self.replays = 0

    def sample(self, plan: SamplingPlan, logits: torch.Tensor, rows: torch.Tensor, bs: int,
               history: TokenHistory
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] \
            | None:
        """Tokens and log-probabilities ([bs] each) of the first ``bs`` of the ``padded``
        rows of ``logits`` ``[padded, V]`` (the decode graph's static output) whose
        ``req_to_token`` rows are ``rows`` ``[padded]`` (static), appended to ``history``, and
        the beam rows' top-k candidates (as :func:`~edserve.engine.sampler.sample` returns
        them); None when ``plan`` is not capturable (the caller samples eagerly)."""
        chain = graph_key(plan)
        if chain is None:
            return None
        key = (logits.shape[0], chain, candidate_key(plan))
        found = self.graphs.get(key)
        if found is None:
            out = sample(logits[:bs], plan, history, rows[:bs])
            if len(self.graphs) < self.max_graphs:
                self._capture(key, plan, logits, rows, history)
            return out
        graph, tokens, logprobs, cands, topk_rows = found
        if topk_rows is not None:  # this step's beam rows into the graph's static index
            topk_rows.copy_(plan.candidates.topk_rows, non_blocking=True)
        graph.replay()
        self.replays += 1
        return tokens[:bs], logprobs[:bs], cands

    @torch.inference_mode()
    def _capture(self, key: tuple, plan: SamplingPlan, logits: torch.Tensor,
                 rows: torch.Tensor, history: TokenHistory) -> None:
        topk_rows = None
        if plan.candidates is not None:  # top-k rows only (candidate_key): a static index
            topk_rows = plan.candidates.topk_rows.clone()
            plan = replace(plan, candidates=replace(plan.candidates, topk_rows=topk_rows))
        graph, (tokens, logprobs, cands) = capture(
            lambda: sample(logits, plan, history, rows), self.device, pool=self.pool)
        self.graphs[key] = (graph, tokens, logprobs, cands, topk_rows)
        logger.debug("captured a sampling graph: %d rows, %d filters, candidates %s",
                     logits.shape[0], len(key[1]), key[2])
