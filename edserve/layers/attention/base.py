"""Attention layer and backend interface.

Models never touch the KV pool or page tables: each attention call goes through an
:class:`Attention` module, which hands ``(q, k, v)`` to the batch's backend. The backend writes
new K/V into the pool and reads the request's region back according to the encoder-KV strategy.

Contract of :meth:`AttentionBackend.forward`:
  * self-attention (``layer.is_cross == False``): ``k``/``v`` are the new tokens' keys/values
    ``[T, Hkv, D]``; they are written at ``batch.out_cache_loc``; each query attends causally
    (bottom-right aligned) over the request's decoder region.
  * cross-attention: at prefill ``k``/``v`` are the projected encoder outputs of the requests
    encoded this step, ``[sum encoder_lens, Hkv, D]``, written once at
    ``batch.encoder_out_cache_loc``; at decode they are ``None`` and read from the pool. Each query
    attends (non-causally) over its request's encoder region. A request with
    ``encoder_len == 0`` gets a zero output and no kernel runs on its empty key set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from edserve.layers.forward_batch import ForwardBatch


class Attention(nn.Module):
    """One attention site of a decoder layer (self or cross); owns no weights."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, is_cross: bool) -> None:
        super().__init__()
        self.layer_id = layer_id  # index into the KV pool's per-layer buffers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.is_cross = is_cross

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                batch: ForwardBatch) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [N, Hkv, D] or None -> out [T, Hq, D]
        return batch.attn_backend.forward(q, k, v, self, batch)


class AttentionBackend(ABC):
    """Reads and writes the paged KV pool for one encoder-KV strategy."""

    name: str = "base"

    @abstractmethod
    def encoder_region(self, encoder_len: int) -> int:
        """Columns reserved at the start of a row for an encoder of ``encoder_len`` tokens."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build index tensors for this batch once and store them on ``batch.attn_metadata``."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: Attention, batch: ForwardBatch) -> torch.Tensor:
        """See the module docstring for the contract."""
