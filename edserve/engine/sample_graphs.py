"""The sampling of a graph-replayed decode step, replayed as a CUDA graph of its own.

After the decoder's graph, a step still launched its sampling eagerly: the logits filters
(openai-whisper's timestamp grammar alone is ~35 small ops), the greedy choice, the
log-probabilities and the token-history append: ~55 launches whose host cost (~1.4 ms per step
on the H200's host at 64 rows) left the device idle between steps. :class:`SampleGraphs`
captures that work once per (padded batch size, filter chain) and replays it, so a steady
decode step launches two graphs.

What a graph can capture (:func:`graph_key`): every row greedy (no temperature, no row group
candidates), one filter chain for the whole batch (or none), and only filters that declare
``capturable = True`` (pure tensor ops, no host state: a recorder is not). Anything else is
sampled eagerly by :func:`~edserve.engine.sampler.sample`, with the same result.

The graph works on all ``padded`` rows of the decode graph's output; the padding rows point at
``req_to_token`` row 0, which no request holds, so their history appends land in the token
history's padding row (:meth:`TokenHistory.append` keeps that row's length bounded even
when it is listed many times). The first step of a key is sampled eagerly (which also builds
the filters' cached device tensors that the capture then bakes in) and the graph is captured
right after it, on a side stream.
"""

from __future__ import annotations

import logging

import torch

from edserve.engine.sampler import SamplingPlan, sample
from edserve.engine.token_history import TokenHistory

logger = logging.getLogger("edserve")

#: Sampling graphs kept per runner: (batch sizes) x (filter chains in use) stays far below it
#: unless requests keep bringing new filter settings; those then sample eagerly.
MAX_GRAPHS = 256


def graph_key(plan: SamplingPlan) -> tuple | None:
    """The filter chain a captured graph can replay for ``plan`` (``()``: no filters), or None
    when ``plan`` must be sampled eagerly."""
    if plan.sampled is not None or plan.candidates is not None:
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
        # (padded, chain) -> (graph, tokens [padded], logprobs [padded])
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0

    def sample(self, plan: SamplingPlan, logits: torch.Tensor, rows: torch.Tensor, bs: int,
               history: TokenHistory) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """Tokens and log-probabilities ([bs] each) of the first ``bs`` of the ``padded``
        rows of ``logits`` ``[padded, V]`` (the decode graph's static output) whose
        ``req_to_token`` rows are ``rows`` ``[padded]`` (static), appended to ``history``;
        None when ``plan`` is not capturable (the caller samples eagerly)."""
        chain = graph_key(plan)
        if chain is None:
            return None
        padded = logits.shape[0]
        found = self.graphs.get((padded, chain))
        if found is None:
            out = sample(logits[:bs], plan, history, rows[:bs])
            if len(self.graphs) < self.max_graphs:
                self._capture(plan, chain, logits, rows, history)
            return out
        graph, tokens, logprobs = found
        graph.replay()
        self.replays += 1
        return tokens[:bs], logprobs[:bs], None

    @torch.inference_mode()
    def _capture(self, plan: SamplingPlan, chain: tuple, logits: torch.Tensor,
                 rows: torch.Tensor, history: TokenHistory) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # thread_local: other threads (the features thread) may use CUDA meanwhile
            with torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                  capture_error_mode="thread_local"):
                tokens, logprobs, _ = sample(logits, plan, history, rows)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[(logits.shape[0], chain)] = (graph, tokens, logprobs)
        logger.debug("captured a sampling graph: %d rows, %d filters", logits.shape[0],
                     len(chain))
