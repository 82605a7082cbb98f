"""Aligned strategy: pad the encoder region to whole pages and read both regions by page table.

A request's encoder takes ``ceil_align(encoder_len, page_size)`` columns, so its decoder region
starts on a page boundary and the page-granular table ``req_to_token[:, ::ps] // ps`` is exact
for both regions (decoder pages start at column ``encoder_offset // ps`` of that table). Costs up
to ``page_size - 1`` wasted slots per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.layers.attention.base import Attention
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.layers.forward_batch import ForwardBatch
from edserve.mem_cache.page_table import page_table_from_req_to_token


def ceil_align(n: int, page_size: int) -> int:
    return (n + page_size - 1) // page_size * page_size


@dataclass
class PagedPlan:
    page_table: torch.Tensor  # [B, max_pages] int32 page ids of each request's row
    kv_start_page: torch.Tensor  # [B] int32: first page of the region
    kv_lens: torch.Tensor  # [B] int32: keys in the region


class AlignedBackend(EncoderDecoderBackend):
    name = "aligned"
    supports_grouped_cross = True

    def encoder_region(self, encoder_len: int) -> int:
        return ceil_align(encoder_len, self.page_size)

    def build_metadata(self, batch: ForwardBatch, skip_cross: bool):
        ps = self.page_size
        if batch.static_shapes:  # CUDA graph: a fixed-width table covering whole rows
            num_pages = batch.req_to_token.shape[1] // ps
        else:
            max_cols = max((o + s for o, s in zip(self._offsets_cpu(batch), batch.seq_lens_cpu,
                                                   strict=True)), default=0)
            num_pages = max(1, (max_cols + ps - 1) // ps)
        table = page_table_from_req_to_token(batch.req_to_token, ps, batch.req_pool_indices,
                                             num_pages)
        zeros = torch.zeros_like(batch.encoder_lens)
        cross = None if skip_cross else PagedPlan(table, zeros, batch.encoder_lens)
        self_ = PagedPlan(table, (batch.encoder_offsets // ps).to(torch.int32), batch.seq_lens)
        return cross, self_

    def grouped_keys(self, batch: ForwardBatch, self_plan: PagedPlan) -> dict:
        """By page: the encoder region starts at page 0 of the batch's page table."""
        return {"page_table": self_plan.page_table, "page_size": self.page_size}

    def _offsets_cpu(self, batch: ForwardBatch) -> list[int]:
        return [self.encoder_region(n) for n in batch.encoder_lens_cpu]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: Attention, batch: ForwardBatch, plan: PagedPlan, cross: bool):
        kw = self._range_kwargs(batch, cross)
        return self.ops.paged(q, k_cache, v_cache, plan.page_table, plan.kv_start_page,
                              plan.kv_lens, batch.cu_q, batch.max_q, not cross, layer.scaling,
                              self.page_size, **kw)
