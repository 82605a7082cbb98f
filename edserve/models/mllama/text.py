"""Mllama text decoder layers: Llama self-attention layers and gated cross-attention layers.

Projections of one input run as one GEMM: self-attention q/k/v (``qkv_proj``), cross-attention
k/v (``kv_proj``), the MLP's gate/up (``gate_up_proj``). They are :class:`FusedLinear` modules
filled from the HF-named checkpoint at load time (:mod:`edserve.models.weights.fused`).

Every attention site goes through :class:`edserve.layers.attention.base.Attention` with a
``layer_id`` into the KV pool from :func:`kv_pool_layers`: self layers keep K/V only at the
decoder region's slots of a request's row, cross layers only at its encoder region's, and the
two regions never share a slot, so the k-th cross layer and the k-th self layer share one pool
layer. The pool holds ``max(self layers, cross layers)`` layers (11B: 32, not 40: a fifth less
KV memory per token) instead of one per text layer.
"""

from __future__ import annotations

import torch
from torch import nn

from edserve.layers.attention.base import Attention
from edserve.layers.elementwise import TORCH_OPS, ElementwiseOps, elementwise_ops
from edserve.layers.forward_batch import ForwardBatch
from edserve.models.mllama.config import MllamaTextConfig
from edserve.models.weights.fused import FusedLinear


def kv_pool_layers(cfg: MllamaTextConfig) -> list[int]:
    """The KV-pool layer of each text layer: cross layers count 0, 1, ... in order, and so do
    self layers (``[S, S, S, C, S, ...]`` -> ``[0, 1, 2, 0, 3, ...]``). A pool layer's slots
    hold one self layer's K/V at decoder slots and at most one cross layer's at encoder
    slots; a slot belongs to one region of one row (or to the padding page, which nothing
    reads), so the two never overwrite each other."""
    cross = set(cfg.cross_attention_layers)
    seen = {True: 0, False: 0}
    out = []
    for i in range(cfg.num_hidden_layers):
        out.append(seen[i in cross])
        seen[i in cross] += 1
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: ElementwiseOps = TORCH_OPS) -> torch.Tensor:
        # x: [..., dim]; ops: the batch's row-wise ops (one fused kernel under triton)
        return ops.rms_norm(x, self.weight, self.eps)


def linear_residual(x: torch.Tensor, h: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """``x + proj(h)``: one ``addmm`` for a plain bias-free ``nn.Linear``; any other module (a
    tensor-parallel shard of one, say) runs as ``x + proj(h)``. x: [T, H]; h: [T, in]."""
    if type(proj) is nn.Linear:
        return torch.addmm(x, h, proj.weight.t())
    return x + proj(h)


class MLP(nn.Module):
    """SwiGLU: down(silu(g) * u) with ``[g | u]`` = one GEMM (``gate_up_proj`` ``[2I, H]``,
    filled from HF's ``gate_proj`` and ``up_proj``)."""

    def __init__(self, cfg: MllamaTextConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = FusedLinear(H, [("gate_proj", inter), ("up_proj", inter)],
                                        bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def act(self, x: torch.Tensor, ops: ElementwiseOps = TORCH_OPS) -> torch.Tensor:
        # x: [T, H] -> silu(g) * u: [T, I]
        g, u = self.gate_up_proj.split(self.gate_up_proj(x))
        return ops.silu_mul(g, u)

    def forward(self, x: torch.Tensor, ops: ElementwiseOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(self.act(x, ops))


class SelfAttention(nn.Module):
    """Llama self-attention: q/k/v as one GEMM (``qkv_proj`` ``[(Hq + 2 Hkv) D, H]``, filled
    from HF's ``q_proj``/``k_proj``/``v_proj``), RoPE, then ``o_proj``."""

    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__()
        H, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = Hq, Hkv, D
        self.qkv_proj = FusedLinear(H, [("q_proj", Hq * D), ("k_proj", Hkv * D),
                                        ("v_proj", Hkv * D)], bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.attn = Attention(layer_id, Hq, Hkv, D, D ** -0.5, is_cross=False)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H] -> attention output before o_proj: [T, Hq * D]
        T, D = x.shape[0], self.head_dim
        ops = elementwise_ops(batch)
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        q = ops.rope(q.view(T, self.num_heads, D), cos, sin)
        k = ops.rope(k.view(T, self.num_kv_heads, D), cos, sin)
        o = self.attn(q, k, v.view(T, self.num_kv_heads, D), batch)  # [T, Hq, D]
        return o.reshape(T, -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, batch))


class SelfAttentionDecoderLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]; the residual adds are folded into o_proj's and down_proj's GEMMs
        ops = elementwise_ops(batch)
        o = self.self_attn.attend(self.input_layernorm(x, ops), cos, sin, batch)  # [T, Hq*D]
        x = linear_residual(x, o, self.self_attn.o_proj)
        h = self.mlp.act(self.post_attention_layernorm(x, ops), ops)  # [T, I]
        return linear_residual(x, h, self.mlp.down_proj)


class CrossAttention(nn.Module):
    """Attention of text tokens over projected vision states: q/k RMSNorm over head_dim, no
    RoPE. K/V are computed once per request (prefill), as one GEMM (``kv_proj``
    ``[2 Hkv D, H]``, filled from HF's ``k_proj``/``v_proj``), and stored in its encoder
    region."""

    def __init__(self, cfg: MllamaTextConfig, layer_id: int) -> None:
        super().__init__()
        H, Hq, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = Hq, Hkv, D
        self.q_proj = nn.Linear(H, Hq * D, bias=False)
        self.kv_proj = FusedLinear(H, [("k_proj", Hkv * D), ("v_proj", Hkv * D)], bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.attn = Attention(layer_id, Hq, Hkv, D, D ** -0.5, is_cross=True)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def project_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # enc: [N, H] projected vision states -> k, v: [N, Hkv, D]
        N = enc.shape[0]
        kv = self.kv_proj(enc).view(N, 2, self.num_kv_heads, self.head_dim)  # [N, 2, Hkv, D]
        return self.k_norm(kv[:, 0]), kv[:, 1]

    def forward(self, x: torch.Tensor, enc: torch.Tensor | None,
                batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim),
                        elementwise_ops(batch))
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
        ops = elementwise_ops(batch)
        h = self.cross_attn(self.input_layernorm(x, ops), enc, batch) * attn_mask
        x = x + self.cross_attn_attn_gate.tanh() * h
        h = self.mlp(self.post_attention_layernorm(x, ops), ops) * mlp_mask
        return x + self.cross_attn_mlp_gate.tanh() * h
