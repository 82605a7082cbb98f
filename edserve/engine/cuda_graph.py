"""CUDA-graph capture of decode steps (aligned and flat strategies).

One graph per padded batch size. A graph reads its inputs from the static buffers of
:class:`~edserve.engine.graph_inputs.GraphInputs`; replay copies a real batch into them and pads
the tail with harmless rows. Metadata is rebuilt inside the graph from the static tensors
(``static_shapes``), so no host value is baked in except the batch size. Requests with and
without an encoder share a graph, and so do Mllama rows with and without an image (their
per-row cross-attention key ranges are a static buffer too).
With the grouped cross-attention kernel (``backend.grouped_cross``) the graph also reads the
batch's padded group table (``ForwardBatch.cross_groups``, ``[bs, MAX_GROUP_ROWS]``): replay
copies the real groups in and makes every padding row a group of one, so one graph serves any
mix of greedy rows and row groups.
Prefill prompts replay the same graphs one position at a time (``prompts``,
:mod:`edserve.engine.prompt_graphs`).
"""

from __future__ import annotations

import functools
import logging

import torch

from edserve.engine.batch_builder import Pools
from edserve.engine.graph_inputs import (
    GraphInputs,
    padded_size,
    reads_cross_kv_ranges,
    static_forward,
)
from edserve.engine.prompt_graphs import PromptReplayer
from edserve.engine.sample_graphs import SampleGraphs
from edserve.engine.sampler import SamplingPlan
from edserve.engine.token_history import TokenHistory
from edserve.layers.forward_batch import ForwardBatch

logger = logging.getLogger("edserve")


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def replay_loaded(graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, torch.Tensor],
                  padded: int) -> torch.Tensor:
    """Replay the graph of size ``padded`` on the inputs as loaded; logits [padded, V]."""
    graphs[padded].replay()
    return outputs[padded]


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, pools: Pools, max_bs: int,
                 prompt_max_tokens: int = 0, sampling: bool = True) -> None:
        if pools.backend.name == "ragged":
            raise ValueError("--cuda-graph needs fixed shapes, but the ragged strategy gathers "
                             "data-dependent buffers every step; use --encoder-kv flat or "
                             "aligned, or drop --cuda-graph")
        if pools.device.type != "cuda":
            raise ValueError("--cuda-graph needs a CUDA device")
        if pools.backend.ops.name != "triton":
            raise ValueError("--cuda-graph needs the triton attention backend (the torch "
                             "reference syncs with the host)")
        self.model = model
        self.pools = pools
        self.max_bs = max_bs
        self.sizes = capture_sizes(max_bs)
        # Ranged models (Mllama) read per row: the grouped kernel takes no key ranges.
        ranged = reads_cross_kv_ranges(model)
        self.inputs = GraphInputs(max_bs, pools.device, ranged,
                                  grouped=pools.backend.grouped_cross and not ranged)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_handle = None
        self._capture_all()
        # the sampling of replayed steps (graph_key decides which plans), in the same pool
        self.sampling = SampleGraphs(pools.device, self.pool_handle) if sampling else None
        # prefill prompts of up to prompt_max_tokens tokens replay these graphs (Whisper);
        # it gets the graphs, not this runner: no reference cycle, so an engine (and its KV
        # pool) is freed as soon as the last reference to it goes
        self.prompts = PromptReplayer(
            self.inputs, self.sizes, functools.partial(replay_loaded, self.graphs, self.outputs),
            prompt_max_tokens) if prompt_max_tokens > 0 and hasattr(model, "write_cross_kv") \
            else None

    def _forward(self, bs: int) -> torch.Tensor:
        return static_forward(self.model, self.pools, self.inputs, bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream(self.pools.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                for _ in range(2):  # warm up (Triton compiles, allocator settles)
                    self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool_handle, stream=stream):
                    self.outputs[bs] = self._forward(bs)
                if self.pool_handle is None:
                    self.pool_handle = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch, plan: SamplingPlan | None = None) -> bool:
        """Whether a graph takes ``batch`` (any ``plan``: :meth:`sample` decides its part)."""
        return self.inputs.accepts(batch)

    def replay(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Run a real decode batch through the smallest graph that fits; logits [B, V]."""
        bs = batch.batch_size
        padded = padded_size(self.sizes, bs)
        self.inputs.load(batch, input_ids, padded)
        return replay_loaded(self.graphs, self.outputs, padded)[:bs]

    def step(self, batch: ForwardBatch, input_ids: torch.Tensor, plan: SamplingPlan,
             history: TokenHistory) -> tuple[torch.Tensor, tuple | None]:
        """``(logits [B, V], picked)``: :meth:`replay`, then :meth:`sample` (None: the caller
        samples the logits)."""
        logits = self.replay(batch, input_ids)
        return logits, self.sample(plan, history, batch.batch_size)

    def sample(self, plan: SamplingPlan, history: TokenHistory, bs: int
               ) -> tuple[torch.Tensor, torch.Tensor, tuple | None] | None:
        """The tokens and log-probabilities ([bs] each) of the :meth:`replay` of ``bs`` rows
        just run, and beam rows' candidates, through a sampling graph; or None (sampling
        graphs off, or ``plan`` not capturable: the caller samples the logits :meth:`replay`
        returned)."""
        if self.sampling is None:
            return None
        padded = padded_size(self.sizes, bs)
        return self.sampling.sample(plan, self.outputs[padded], self.inputs.rows[:padded], bs,
                                    history)
