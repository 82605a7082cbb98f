"""CUDA-graph capture of decode steps (aligned and flat strategies).

One graph per padded batch size. A graph reads its inputs from static buffers; replay copies a
real batch into them and pads the tail with harmless rows: row 0 of ``req_to_token`` (padding),
KV slot 0 (the padding page), encoder length 0 (cross-attention output zeroed), one decoder token.
Metadata is rebuilt inside the graph from the static tensors (``static_shapes``), so no host
value is baked in except the batch size. Requests with and without an encoder share a graph.

With the grouped cross-attention kernel (``backend.grouped_cross``) the graph also reads the
batch's padded group table (``ForwardBatch.cross_groups``, ``[bs, MAX_GROUP_ROWS]``): replay
copies the real groups in and makes every padding row a group of one, so one graph serves any
mix of greedy rows and row groups.
"""

from __future__ import annotations

import logging

import torch

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.batch_builder import Pools
from edserve.engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger("edserve")


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, pools: Pools, max_bs: int) -> None:
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
        dev = pools.device
        self.sizes = capture_sizes(max_bs)
        n = max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.out_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.enc_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.enc_offsets = torch.zeros(n, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.grouped = pools.backend.grouped_cross
        # [n, W] row i = [i, -1, ...]: every row a group of one (capture, and padding rows)
        self.single_groups = torch.full((n, MAX_GROUP_ROWS), -1, dtype=torch.int64, device=dev)
        self.single_groups[:, 0] = torch.arange(n, device=dev)
        self.cross_groups = self.single_groups.clone()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_handle = None
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        p = self.pools
        return ForwardBatch(
            mode=ForwardMode.DECODE, req_pool_indices=self.rows[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.seq_lens[:bs] - 1,
            cu_q=self.cu_q[:bs + 1], max_q=1, positions=self.positions[:bs],
            out_cache_loc=self.out_loc[:bs], encoder_lens=self.enc_lens[:bs],
            encoder_offsets=self.enc_offsets[:bs],
            req_to_token=p.req_to_token_pool.req_to_token, kv_pool=p.kv_pool,
            attn_backend=p.backend, page_size=p.kv_pool.page_size, static_shapes=True,
            cross_groups=self.cross_groups[:bs] if self.grouped else None)

    def _forward(self, bs: int) -> torch.Tensor:
        batch = self._batch(bs)
        self.pools.backend.init_forward_metadata(batch)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], batch, None)
        return self.model.compute_logits(hidden)  # [bs, V]

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

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs
                and batch.cross_kv_ranges is None  # no per-token encoder ranges (Mllama)
                and (batch.cross_groups is not None) == self.grouped)

    def replay(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Run a real decode batch through the smallest graph that fits; logits [B, V]."""
        bs = batch.batch_size
        padded = next(s for s in self.sizes if s >= bs)
        for buf, src, fill in ((self.input_ids, input_ids, 0),
                               (self.positions, batch.positions, 0),
                               (self.rows, batch.req_pool_indices, 0),
                               (self.seq_lens, batch.seq_lens, 1),
                               (self.out_loc, batch.out_cache_loc, 0),
                               (self.enc_lens, batch.encoder_lens, 0),
                               (self.enc_offsets, batch.encoder_offsets, 0)):
            buf[:bs].copy_(src)
            buf[bs:padded].fill_(fill)
        if self.grouped:
            self.cross_groups[:bs].copy_(batch.cross_groups)
            self.cross_groups[bs:padded].copy_(self.single_groups[bs:padded])
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]
