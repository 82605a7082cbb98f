"""Shared machinery of the encoder-decoder backends: KV writes and the empty-encoder guard
(rows of requests without encoder keys get a zero cross-attention output: a device-side
``where`` after the per-row read; the grouped kernel writes those zeros itself).

Subclasses (one per encoder-KV strategy) only say where a request's encoder region ends and how
its two regions are read (:meth:`build_metadata`, :meth:`attend`), and, if they can, how a row
group's shared encoder region is found by the grouped cross-attention kernel
(:meth:`grouped_keys`).

Rows sharing an encoder region (a beam / best_of group) read it once per step: through the
grouped kernel when the op set has one and the batch carries its group structure
(``ForwardBatch.cross_groups``; eager and CUDA-graph decode alike), else, on the eager path,
through :meth:`ForwardBatch.cross_view` (one entry per run of rows).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from edserve.layers.attention.base import Attention, AttentionBackend
from edserve.layers.attention.ops import AttentionOps
from edserve.layers.forward_batch import ForwardBatch


@dataclass
class GuardMetadata:
    """Which queries belong to requests without an encoder (built once per batch)."""

    all_empty: bool  # no request has encoder keys: cross-attention launches nothing
    any_empty: bool
    empty_q: torch.Tensor | None  # [T] bool: query rows of requests with encoder_len == 0


@dataclass
class GroupedCross:
    """Read plan of the grouped cross-attention kernel (decode)."""

    group_rows: torch.Tensor  # [G, W] batch rows of each group sharing one region, -1 padding
    kv_lens: torch.Tensor  # [B] encoder keys of each row
    keys: dict[str, Any]  # how keys are found: req_to_token + req_pool_indices, or page table


@dataclass
class EncDecMetadata:
    guard: GuardMetadata
    cross: Any  # strategy-specific read plan for the encoder region
    self_: Any  # strategy-specific read plan for the decoder region
    cross_batch: ForwardBatch | None = None  # ForwardBatch.cross_view(), when rows share
    grouped: GroupedCross | None = None  # set: cross-attention runs the grouped kernel


class EncoderDecoderBackend(AttentionBackend):
    name = "encdec"
    supports_grouped_cross = False  # the strategy implements grouped_keys

    def __init__(self, page_size: int, ops: AttentionOps, grouped_cross: bool = True) -> None:
        self.page_size = page_size
        self.ops = ops
        # Decode batches carry their row groups (cross_groups) and read each shared encoder
        # region once with the grouped kernel; False: the per-row read (for A/B measurement).
        self.grouped_cross = grouped_cross and self.supports_grouped_cross \
            and ops.grouped_cross is not None

    def encoder_region(self, encoder_len: int) -> int:
        return encoder_len

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        q_lens = batch.cu_q[1:] - batch.cu_q[:-1]  # [B]
        empty_req = batch.encoder_lens == 0  # [B]
        if batch.static_shapes:  # CUDA graph: decide nothing on the host; kernels see kv_len 0
            guard = GuardMetadata(False, True, empty_req)  # decode: one query per request
        else:
            all_empty = all(n == 0 for n in batch.encoder_lens_cpu)
            any_empty = any(n == 0 for n in batch.encoder_lens_cpu)
            empty_q = None
            if any_empty and not all_empty:
                empty_q = torch.repeat_interleave(empty_req, q_lens.long(),
                                                  output_size=batch.num_tokens)
            guard = GuardMetadata(all_empty, any_empty, empty_q)
        grouped = batch.cross_groups is not None and batch.cross_kv_ranges is None \
            and not guard.all_empty
        view = None if batch.static_shapes or grouped else batch.cross_view()
        cross, self_ = self.build_metadata(
            batch, skip_cross=guard.all_empty or view is not None or grouped)
        if view is not None and not guard.all_empty:  # rows sharing an encoder read it once
            cross, _ = self.build_metadata(view, skip_cross=False)
        plan = GroupedCross(batch.cross_groups, batch.encoder_lens,
                            self.grouped_keys(batch, self_)) if grouped else None
        batch.attn_metadata = EncDecMetadata(guard, cross, self_, view, plan)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: Attention, batch: ForwardBatch) -> torch.Tensor:
        meta: EncDecMetadata = batch.attn_metadata
        pool = batch.kv_pool
        if layer.is_cross:
            self.write_cross(layer, k, v, batch)
            if meta.guard.all_empty:  # never launch a kernel on an empty key set
                return torch.zeros_like(q)
            k_cache, v_cache = pool.get_kv(layer.layer_id)
            g = meta.grouped
            if g is not None:  # rows of a group: one read of their shared region; the kernel
                # writes zeros for rows without keys (kv_lens 0), so no guard pass follows
                return self.ops.grouped_cross(q, k_cache, v_cache, g.group_rows, g.kv_lens,
                                              layer.scaling, **g.keys)
            out = self.attend(q, k_cache, v_cache, layer, meta.cross_batch or batch,
                              meta.cross, cross=True)
            if meta.guard.empty_q is not None:  # mixed batch: zero only the empty requests
                out = torch.where(meta.guard.empty_q[:, None, None], torch.zeros_like(out), out)
            return out
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = pool.get_kv(layer.layer_id)
        return self.attend(q, k_cache, v_cache, layer, batch, meta.self_, cross=False)

    def write_cross(self, layer: Attention, k: torch.Tensor | None, v: torch.Tensor | None,
                    batch: ForwardBatch) -> None:
        """Write a prefill's encoder K/V ``[sum encoder_lens, Hkv, D]`` into ``layer``'s pool
        slots ``batch.encoder_out_cache_loc`` (nothing for None or no rows)."""
        if k is not None and k.shape[0] > 0:
            batch.kv_pool.set_kv(layer.layer_id, batch.encoder_out_cache_loc, k, v)

    @abstractmethod
    def build_metadata(self, batch: ForwardBatch, skip_cross: bool) -> tuple[Any, Any]:
        """Index tensors for reading the encoder region (cross) and decoder region (self)."""

    def grouped_keys(self, batch: ForwardBatch, self_plan: Any) -> dict[str, Any]:
        """Where the grouped kernel finds a row's encoder keys (its addressing keywords);
        strategies with ``supports_grouped_cross`` implement it."""
        raise NotImplementedError(f"the {self.name!r} strategy has no grouped cross-attention")

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: Attention, batch: ForwardBatch, plan: Any, cross: bool) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over one region; returns ``[T, Hq, D]``."""

    def _range_kwargs(self, batch: ForwardBatch, cross: bool) -> dict[str, torch.Tensor]:
        """Per-query encoder key ranges (Mllama), passed only when a batch has them."""
        if not cross or batch.cross_kv_ranges is None:
            return {}
        if not self.ops.supports_kv_ranges:
            raise NotImplementedError(
                f"the {self.ops.name!r} attention ops do not support per-token cross-attention "
                "ranges; use --attention-backend torch")
        return {"kv_ranges": batch.cross_kv_ranges}
