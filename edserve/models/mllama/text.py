"""Mllama text decoder layers: Llama self-attention layers and gated cross-attention layers.

Every attention site goes through :class:`edserve.layers.attention.base.Attention` with
``layer_id`` = the text layer index, so the KV pool holds one layer per text layer: self layers
use the decoder region of a request's row, cross layers its encoder region.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edserve.engine.forward_batch import ForwardBatch
from edserve.layers.attention.base import Attention
from edserve.models.mllama.config import MllamaTextConfig
from edserve.models.mllama.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: MllamaTextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Projections(nn.Module):
    """q/k/v/o projections (HF names, no biases) and the attention site, for either kind."""

    def __init__(self, cfg: MllamaTextConfig, layer_id: int, is_cross: bool) -> None:
        super().__init__()
        H, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = Hq, Hkv, D
        self.q_proj = nn.Linear(H, Hq * D, bias=False)
        self.k_proj = nn.Linear(H, Hkv * D, bias=False)
        self.v_proj = nn.Linear(H, Hkv * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.attn = Attention(layer_id, Hq, Hkv, D, D ** -0.5, is_cross=is_cross)


class SelfAttention(_Projections):
    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id, is_cross=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))


class SelfAttentionDecoderLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class CrossAttention(_Projections):
    """Attention of text tokens over projected vision states: q/k RMSNorm over head_dim, no
    RoPE. K/V are computed once per request (prefill) and stored in its encoder region."""

    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id, is_cross=True)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # enc: [N, H] projected vision states -> k, v: [N, Hkv, D]
        N = enc.shape[0]
        k = self.k_norm(self.k_proj(enc).view(N, self.num_kv_heads, self.head_dim))
        v = self.v_proj(enc).view(N, self.num_kv_heads, self.head_dim)
        return k, v

    def forward(self, x: torch.Tensor, enc: torch.Tensor | None,
                batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))
        k, v = self.project_kv(enc) if enc is not None else (None, None)
        o = self.attn(q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))


class CrossAttentionDecoderLayer(nn.Module):
    """``h = x + tanh(g_attn) * attn_mask * CrossAttn(LN(x))``;
    ``out = h + tanh(g_mlp) * mlp_mask * MLP(LN(h))`` (masks: per token, ``[T, 1]``)."""

    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__()
        self.cross_attn = CrossAttention(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, enc: torch.Tensor | None, batch: ForwardBatch,
                attn_mask: torch.Tensor, mlp_mask: torch.Tensor) -> torch.Tensor:
        h = self.cross_attn(self.input_layernorm(x), enc, batch) * attn_mask
        x = x + self.cross_attn_attn_gate.tanh() * h
        h = self.mlp(self.post_attention_layernorm(x)) * mlp_mask
        return x + self.cross_attn_mlp_gate.tanh() * h
