"""Ragged strategy: gather each request's token slots into one contiguous buffer per forward and
run variable-length attention (``cu_seqlens``). Page-size agnostic, but pays a copy of every KV
row it reads, and its shapes depend on the data, so it cannot be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.layers.attention.base import Attention
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.layers.forward_batch import ForwardBatch


@dataclass
class RaggedPlan:
    slots: torch.Tensor  # [sum kv_lens] int64: slots of all requests' keys, concatenated
    cu_k: torch.Tensor  # [B+1] int32 offsets into ``slots``
    max_k: int


def _gather_plan(batch: ForwardBatch, start: torch.Tensor, lens: list[int]) -> RaggedPlan:
    dev = batch.req_to_token.device
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    total = int(sum(lens))
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = torch.cumsum(lens_t, 0)
    req = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t, output_size=total)
    col = torch.arange(total, device=dev) - cu_k[:-1].long()[req] + start.long()[req]
    rows = batch.req_pool_indices.long()[req]
    slots = batch.req_to_token[rows, col].long()
    return RaggedPlan(slots, cu_k, max(lens, default=0))


class RaggedBackend(EncoderDecoderBackend):
    name = "ragged"

    def build_metadata(self, batch: ForwardBatch, skip_cross: bool):
        if batch.static_shapes:
            raise ValueError("the ragged strategy has data-dependent shapes and cannot be "
                             "captured in a CUDA graph; use --encoder-kv flat or aligned")
        zeros = torch.zeros_like(batch.encoder_lens)
        cross = None if skip_cross else _gather_plan(batch, zeros, batch.encoder_lens_cpu)
        return cross, _gather_plan(batch, batch.encoder_offsets, batch.seq_lens_cpu)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: Attention, batch: ForwardBatch, plan: RaggedPlan, cross: bool):
        k = k_cache[plan.slots]  # [sum kv_lens, Hkv, D]: the gather copy this strategy pays
        v = v_cache[plan.slots]
        kw = self._range_kwargs(batch, cross)
        return self.ops.varlen(q, k, v, batch.cu_q, plan.cu_k, batch.max_q, plan.max_k,
                               not cross, layer.scaling, **kw)
