"""A step's :class:`ForwardBatch` as a message for the other ranks, and back.

Rank 0 owns the scheduler, the request-to-token table and the KV allocator; the other ranks own
only their KV pool shard (same slots, ``num_kv_heads / N`` heads). A forward call therefore
carries every index tensor of the batch (so every rank writes and reads the same slots) and the
rows of ``req_to_token`` the batch reads, trimmed to the columns in use: on the other ranks the
batch's ``req_to_token`` is that ``[B, W]`` table and its rows are ``0 .. B-1``.
"""

from __future__ import annotations

from typing import Any

import torch

from edserve.layers.forward_batch import ForwardBatch, ForwardMode

# ForwardBatch tensors sent as they are (None allowed for the optional ones)
_TENSORS = ("seq_lens", "prefix_lens", "cu_q", "out_cache_loc", "encoder_lens",
            "encoder_offsets", "encoder_out_cache_loc", "cross_kv_ranges")
# host-side ForwardBatch fields sent as they are
_HOST = ("max_q", "page_size", "seq_lens_cpu", "encoder_lens_cpu", "q_starts_cpu",
         "cross_runs", "static_shapes")


def _columns_in_use(batch: ForwardBatch) -> int:
    """Columns of the batch's rows that attention may read (whole pages, within the table)."""
    region = batch.attn_backend.encoder_region
    cols = max((region(e) + s for e, s in zip(batch.encoder_lens_cpu, batch.seq_lens_cpu,
                                              strict=True)), default=0)
    ps = batch.page_size
    return min(batch.req_to_token.shape[1], max(ps, -(-cols // ps) * ps))


def pool_geometry(batch: ForwardBatch) -> dict[str, Any]:
    """What another rank needs to build its KV pool shard and attention backend."""
    pool, backend = batch.kv_pool, batch.attn_backend
    return dict(num_slots=pool.num_slots, page_size=pool.page_size, num_layers=pool.num_layers,
                num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=pool.dtype,
                strategy=backend.name, ops=backend.ops.name)


def batch_message(batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                  has_encoder_states: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(host meta, tensors) of one forward call on rank 0."""
    if batch.static_shapes:
        raise RuntimeError("tensor parallelism does not mirror CUDA-graph batches")
    rows = batch.req_to_token[batch.req_pool_indices, :_columns_in_use(batch)]  # [B, W] int32
    present = [n for n in _TENSORS if getattr(batch, n) is not None]
    meta = {n: getattr(batch, n) for n in _HOST}
    meta.update(mode=batch.mode.name, present=present, has_encoder_states=has_encoder_states,
                geometry=pool_geometry(batch))
    return meta, [input_ids, positions, rows] + [getattr(batch, n) for n in present]


def batch_from_message(meta: dict[str, Any], tensors: list[torch.Tensor], kv_pool,
                       backend) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """(input_ids, positions, batch) on another rank, over its own pool shard and backend."""
    input_ids, positions, rows = tensors[:3]
    fields = dict(zip(meta["present"], tensors[3:], strict=True))
    B = rows.shape[0]
    batch = ForwardBatch(
        mode=ForwardMode[meta["mode"]], req_pool_indices=torch.arange(B, device=rows.device),
        positions=positions, req_to_token=rows.contiguous(), kv_pool=kv_pool,
        attn_backend=backend, **{n: meta[n] for n in _HOST},
        **{n: fields.get(n) for n in _TENSORS})
    return input_ids, positions, batch


def read_slots(batch: ForwardBatch) -> torch.Tensor:
    """Every KV slot the batch's attention reads: each row's encoder region
    ``[0, encoder_len)`` and decoder region ``[offset, offset + seq_len)``. ``[K]`` int64."""
    table = batch.req_to_token  # [B, W]
    col = torch.arange(table.shape[1], device=table.device)[None, :]  # [1, W]
    off, enc = batch.encoder_offsets.long()[:, None], batch.encoder_lens.long()[:, None]
    dec_end = off + batch.seq_lens.long()[:, None]
    used = (col < enc) | ((col >= off) & (col < dec_end))  # [B, W]
    return table[used].long()


def kv_digest(pool) -> torch.Tensor:
    """``[layers, heads, 2]`` float64: the sum of every K and of every V value per layer and
    head over all of the pool's buffer slots (free ones included: equal schedules leave equal
    pools), to compare one rank's shard with the matching heads of an unsplit pool."""
    return torch.stack([torch.stack([k.double().sum(dim=(0, 2)), v.double().sum(dim=(0, 2))],
                                    dim=-1) for k, v in zip(pool.k_buffers, pool.v_buffers,
                                                            strict=True)])
