"""Views of the KV cache the engine hands its callers: a held encoder region
(:class:`EncoderKV`, from ``keep_encoder`` / ``share_encoder``, passed back as a request's
``encoder_kv``) and a finished request's KV (:class:`FinishedKV`, for ``on_finished_kv`` hooks
and readouts). Re-exported by :mod:`edserve.engine.request`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

_handle_ids = itertools.count(1)


@dataclass(frozen=True, eq=False)
class EncoderKV:
    """A held encoder region: the slots of columns ``0 .. enc_region-1`` of the row that
    computed it (pages counted once more in the allocator until released)."""

    slots: torch.Tensor  # [enc_region] int64 KV slots (device)
    encoder_len: int
    enc_region: int
    id: int = field(default_factory=lambda: next(_handle_ids))
    # no other handle counts these pages (taken from a row that computed its own encoder):
    # once no live request reuses it, releasing it frees every page without a host read
    exclusive: bool = False


@dataclass(frozen=True)
class FinishedKV:
    """A finished request's KV, readable until the callback returns (then it is freed).

    Row layout (every encoder-KV strategy): columns ``0 .. encoder_len-1`` hold the encoder
    tokens' slots, the decoder tokens start at column ``enc_region``.
    """

    row_slots: torch.Tensor  # [row_len] int64 KV slots of the row (device)
    encoder_len: int
    enc_region: int
    kv_pool: Any  # KVPool: get_kv(layer) -> (k [slots, H, D], v [slots, H, D])
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, stop token excluded

    @property
    def encoder_slots(self) -> torch.Tensor:
        """[encoder_len] int64 slots of the encoder (cross-attention) K/V."""
        return self.row_slots[:self.encoder_len]
