"""The static tensors a captured decode graph reads, and the forward it captures.

A CUDA graph bakes in tensor addresses, so every per-step input lives in one preallocated
buffer of ``max_bs`` rows; :meth:`GraphInputs.load` copies a real decode batch into the first
``bs`` rows and pads the rest with harmless rows (row 0 of ``req_to_token``, KV slot 0 = the
padding page, encoder length 0, key range ``[0, 0)``). :func:`static_forward` is the function a
graph captures; it runs eagerly as well (on any device), which is how the CPU tests check that
the graph path reads what the eager path reads.

Models whose text tokens see only part of the encoder output (Mllama: ``reads_cross_kv_ranges``)
get a static ``[max_bs, 2]`` key-range buffer, so decode batches that mix image rows and
text-only rows replay one graph: a row without a range (text-only request, or a request that
does not restrict its keys) reads ``[0, encoder_len)``, and rows of length 0 are zeroed by the
backend's device-side guard (or the grouped kernel) and the model's row masks, with no host
branch on values.
"""

from __future__ import annotations

import torch

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.batch_builder import Pools
from edserve.layers.forward_batch import ForwardBatch, ForwardMode


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest captured batch size in ``sizes`` (ascending) that holds ``n`` rows."""
    return next(s for s in sizes if s >= n)


def reads_cross_kv_ranges(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decode batches may carry ``cross_kv_ranges`` (Mllama)."""
    return bool(getattr(model, "reads_cross_kv_ranges", False))


class GraphInputs:
    """Per-step inputs of the decode graphs: one buffer per :class:`ForwardBatch` tensor."""

    def __init__(self, max_bs: int, device: torch.device, ranged: bool,
                 grouped: bool = False) -> None:
        n = max_bs
        self.max_bs = max_bs
        self.ranged, self.grouped = ranged, grouped
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)  # [n]
        self.positions = torch.zeros(n, **i64)  # [n]
        self.rows = torch.zeros(n, **i64)  # [n] rows of req_to_token
        self.seq_lens = torch.ones(n, **i32)  # [n]
        self.out_loc = torch.zeros(n, **i64)  # [n] KV slot of each new token
        self.enc_lens = torch.zeros(n, **i32)  # [n]
        self.enc_offsets = torch.zeros(n, **i32)  # [n]
        self.cu_q = torch.arange(n + 1, **i32)  # [n + 1] one query per row
        # [n, 2] visible encoder keys [start, end) of each row's query (ranged models only)
        self.cross_ranges = torch.zeros(n, 2, **i32) if ranged else None
        # [n, MAX_GROUP_ROWS] rows of each row's group, -1 padded (grouped cross-attention);
        # row i of single_groups = [i, -1, ...]: a group of one (capture, and padding rows)
        self.single_groups = torch.full((n, MAX_GROUP_ROWS), -1, **i64)
        self.single_groups[:, 0] = torch.arange(n, device=device)
        self.cross_groups = self.single_groups.clone() if grouped else None

    def batch(self, pools: Pools, bs: int) -> ForwardBatch:
        """The first ``bs`` rows as a fixed-shape decode batch (``static_shapes``)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, req_pool_indices=self.rows[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.seq_lens[:bs] - 1,
            cu_q=self.cu_q[:bs + 1], max_q=1, positions=self.positions[:bs],
            out_cache_loc=self.out_loc[:bs], encoder_lens=self.enc_lens[:bs],
            encoder_offsets=self.enc_offsets[:bs],
            req_to_token=pools.req_to_token_pool.req_to_token, kv_pool=pools.kv_pool,
            attn_backend=pools.backend, page_size=pools.kv_pool.page_size,
            cross_kv_ranges=None if self.cross_ranges is None else self.cross_ranges[:bs],
            cross_groups=None if self.cross_groups is None else self.cross_groups[:bs],
            static_shapes=True)

    def accepts(self, batch: ForwardBatch) -> bool:
        """A decode batch these buffers can hold (size, and key ranges only if ranged). Its
        group table is copied when grouped, and ignored otherwise (rows then read their
        encoder K/V one by one, which gives the same result)."""
        return (batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs
                and (batch.cross_kv_ranges is None or self.ranged))

    def load(self, batch: ForwardBatch, input_ids: torch.Tensor, padded: int) -> None:
        """Copy a real decode batch (``input_ids`` ``[B]``) into rows ``[0, B)`` and pad rows
        ``[B, padded)``; device copies only (no sync)."""
        bs = batch.batch_size
        self.load_rows(padded, input_ids, batch.positions, batch.req_pool_indices,
                       batch.seq_lens, batch.out_cache_loc, batch.encoder_lens,
                       batch.encoder_offsets)
        if self.cross_groups is not None:  # a batch without a table: groups of one
            groups = self.single_groups if batch.cross_groups is None else batch.cross_groups
            self.cross_groups[:bs].copy_(groups[:bs])
            if padded > bs:
                self.cross_groups[bs:padded].copy_(self.single_groups[bs:padded])
        if self.cross_ranges is None:
            return
        rng = self.cross_ranges
        if batch.cross_kv_ranges is not None:
            rng[:bs].copy_(batch.cross_kv_ranges)
        else:  # every row sees all of its encoder keys
            rng[:bs, 0].zero_()
            rng[:bs, 1].copy_(batch.encoder_lens)
        if padded > bs:
            rng[bs:padded].zero_()

    def load_rows(self, padded: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor, seq_lens: torch.Tensor, out_loc: torch.Tensor,
                  enc_lens: torch.Tensor, enc_offsets: torch.Tensor) -> None:
        """Copy one decode step's per-row tensors (all ``[bs]``, device) into rows ``[0, bs)``
        and pad rows ``[bs, padded)``. Row groups and key ranges are the caller's
        (:meth:`load` for a decode batch, :meth:`ungrouped` for rows without groups)."""
        bs = input_ids.shape[0]
        for buf, src, fill in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                               (self.rows, rows, 0), (self.seq_lens, seq_lens, 1),
                               (self.out_loc, out_loc, 0), (self.enc_lens, enc_lens, 0),
                               (self.enc_offsets, enc_offsets, 0)):
            buf[:bs].copy_(src)
            if padded > bs:  # (an empty fill still costs a dispatch: 7 a step)
                buf[bs:padded].fill_(fill)

    def ungrouped(self, padded: int) -> None:
        """Rows ``[0, padded)`` as groups of one (a step whose rows share no encoder region)."""
        if self.cross_groups is not None:
            self.cross_groups[:padded].copy_(self.single_groups[:padded])


def static_forward(model: torch.nn.Module, pools: Pools, inputs: GraphInputs,
                   bs: int) -> torch.Tensor:
    """The captured work: metadata from the static tensors, decoder forward, logits
    ``[bs, V]``."""
    batch = inputs.batch(pools, bs)
    pools.backend.init_forward_metadata(batch)
    hidden = model(inputs.input_ids[:bs], inputs.positions[:bs], batch, None)
    return model.compute_logits(hidden)  # [bs, V]
