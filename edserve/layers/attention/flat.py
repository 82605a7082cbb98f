"""Flat strategy: read token slots straight from ``req_to_token`` (the pool viewed as page size 1).

No copy and no padding; the decoder region starts at column ``encoder_len``. Shapes depend only
on the batch size, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edserve.layers.attention.base import Attention
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.layers.forward_batch import ForwardBatch
from edserve.mem_cache.page_table import page_table_from_req_to_token


@dataclass
class FlatPlan:
    kv_start: torch.Tensor  # [B] int32: first column of the region in the row
    kv_lens: torch.Tensor  # [B] int32: keys in the region
    # what the op computes once for every layer of this batch (torch ops: key indices, masks)
    memo: dict = field(default_factory=dict)


class FlatBackend(EncoderDecoderBackend):
    name = "flat"
    supports_grouped_cross = True

    def build_metadata(self, batch: ForwardBatch, skip_cross: bool):
        zeros = torch.zeros_like(batch.encoder_lens)
        cross = None if skip_cross else FlatPlan(zeros, batch.encoder_lens)
        return cross, FlatPlan(batch.encoder_offsets, batch.seq_lens)

    def grouped_keys(self, batch: ForwardBatch, self_plan: FlatPlan) -> dict:
        """The encoder region starts at column 0 of each row. With pages (``page_size`` > 1)
        a row's columns fill whole pages in order, shared and copied-on-write pages included
        (the paged allocator's layout), so the encoder keys are read a page at a time through
        ``req_to_token[:, ::ps] // ps``: 130 vs 151 us per large-v3 layer at 64 rows on the
        H200 against one slot index per key (``benchmarks/cross_decode_gpu.py``)."""
        ps = self.page_size
        if ps == 1:
            return {"req_to_token": batch.req_to_token,
                    "req_pool_indices": batch.req_pool_indices}
        num_pages = -(-batch.req_to_token.shape[1] // ps)  # whole rows: fixed in CUDA graphs
        table = page_table_from_req_to_token(batch.req_to_token, ps, batch.req_pool_indices,
                                             num_pages)
        return {"page_table": table, "page_size": ps}

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: Attention, batch: ForwardBatch, plan: FlatPlan, cross: bool):
        kw = self._range_kwargs(batch, cross)
        return self.ops.flat(q, k_cache, v_cache, batch.req_to_token, batch.req_pool_indices,
                             plan.kv_start, plan.kv_lens, batch.cu_q, batch.max_q,
                             not cross, layer.scaling, memo=plan.memo, **kw)
