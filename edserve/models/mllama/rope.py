"""Llama-3 rotary position embedding (rotate-half layout): frequencies and cos/sin tables; the
rotation itself is a row-wise op (``edserve.layers.elementwise``: ``ops.rope``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from edserve.models.mllama.config import RopeConfig


def rope_inv_freq(cfg: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies, llama3-scaled when configured."""
    inv = 1.0 / (cfg.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if cfg.rope_type == "default":
        return inv
    old = cfg.original_max_position_embeddings
    low_wavelen = old / cfg.low_freq_factor
    high_wavelen = old / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / cfg.factor, inv)
    smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg, head_dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions: [T] -> cos, sin: [T, 1, head_dim] (broadcast over heads)
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
