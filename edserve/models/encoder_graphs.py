"""CUDA graphs of an audio encoder at fixed batch sizes (``--encoder-cuda-graph-max-bs``).

At small batches the encoder is bound by the host: large-v3 launches ~400 kernels per forward
(on the H200 a batch of 1 took 12.2 ms per clip, a batch of 16 6.2 ms), and in a server the
engine's one stepping thread spends that launch time on every prefill (wave 33: 22 % of the
thread at 32 clients, cuDNN attention's host side most of it). One graph per batch size 1, 2,
3, ... up to the maximum replays a whole forward in one launch (every size: a batch padded up
to the next power of two would compute up to ~2x the clips; the graphs share one memory pool,
so a size keeps only its static input and output, ~4.6 MB a clip for large-v3: 0.6 GB for
every size up to 16, taken before the KV pools are sized). A batch of ``N`` runs in the
smallest captured size ``>= N``: its log-mels go into the first ``N`` rows of that graph's
static input, the other rows keep what they held (rows never mix in the encoder: every op
works per row or per clip, so they cannot change the first ``N``), and the first ``N`` rows of
the static output are cloned out. Larger batches run eagerly.
The graphs capture the encoder as it is (eager or ``--compile-encoder``'s compiled layers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("edserve")


def encoder_graph_sizes(max_bs: int) -> list[int]:
    """Batch sizes captured: every size 1..``max_bs`` (no clip computed for padding)."""
    if max_bs < 1:
        raise ValueError(f"encoder CUDA graphs need a batch size >= 1, got {max_bs}")
    return list(range(1, max_bs + 1))


class EncoderGraphs:
    """Captured forwards of ``encoder`` (input ``[bs, *input_shape]`` in ``dtype``)."""

    def __init__(self, encoder: nn.Module, max_bs: int, input_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"--encoder-cuda-graph-max-bs needs a CUDA device, got {device}")
        self.encoder = encoder
        self.sizes = encoder_graph_sizes(max_bs)
        self.inputs: dict[int, torch.Tensor] = {}  # bs -> static input [bs, *input_shape]
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> static output [bs, S, d]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(input_shape, dtype, device)

    @torch.inference_mode()
    def _capture(self, input_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        pool = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                x = torch.zeros((bs, *input_shape), dtype=dtype, device=device)
                for _ in range(2):  # warm up (kernel selection, compilation, allocator)
                    self.encoder(x)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self.encoder(x)
                pool = graph.pool() if pool is None else pool
                self.inputs[bs], self.graphs[bs] = x, graph
        torch.cuda.current_stream(device).wait_stream(stream)
        logger.info("captured encoder CUDA graphs for batch sizes %s", self.sizes)

    @torch.inference_mode()
    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """The encoder's output for ``x`` ``[N, *input_shape]`` (any float dtype: cast on the
        copy in), or None when ``N`` exceeds the largest captured size."""
        n = x.shape[0]
        bs = next((s for s in self.sizes if s >= n), None)
        if bs is None:
            return None
        self.inputs[bs][:n].copy_(x)
        self.graphs[bs].replay()
        return self.outputs[bs][:n].clone()
