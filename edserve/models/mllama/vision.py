"""Mllama vision encoder: tiled ViT with gated tile/position embeddings, a local and a gated
global transformer, and intermediate-layer features. Plain nn.Module, HF parameter names
except the fused ``self_attn.qkv_proj``.

Every residual add is fused into the LayerNorm that reads its sum next
(:mod:`edserve.layers.add_norm`: one Triton kernel on CUDA, the eager torch ops elsewhere): a
layer takes the stream and the previous layer's pending MLP output (with its tanh'ed gate in
the global layers), and leaves its own MLP output pending. Where the full stream is needed
without a norm (an intermediate feature saved, the global transformer's output) the pending
output is added first (``add_pending``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edserve.kernels.fa3_attention import fa3_unsupported
from edserve.kernels.tma_attention import has_tma, tma_chunks
from edserve.layers.add_norm import NO_PENDING, AddNormOps, Pending, add_norm_ops, add_pending
from edserve.layers.linear_gelu import LinearGelu, linear_gelu_exact
from edserve.models.mllama.config import MllamaVisionConfig
from edserve.models.mllama.vision_plan import VISION_KERNELS, VISION_PLANS, VisionPlan
from edserve.models.weights.fused import FusedLinear


class VisionAttention(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.num_heads = cfg.attention_heads
        self.head_dim = cfg.head_dim
        # q/k/v as one GEMM, filled from HF's q_proj/k_proj/v_proj at load time
        self.qkv_proj = FusedLinear(D, [("q_proj", D), ("k_proj", D), ("v_proj", D)],
                                    bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        # x: [N, L, D] in the plan's token order
        N, L, _ = x.shape
        qkv = self.qkv_proj(x).view(N, L, 3, self.num_heads, self.head_dim)  # [N, L, 3, H, hd]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [N, H, L, hd] (views)
        o = plan.attend(q, k, v)  # [N, L, H, hd]
        return self.o_proj(o.reshape(N, L, -1))  # [N, L, H * hd] -> [N, L, D]


class VisionMLP(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.linear_gelu: LinearGelu = linear_gelu_exact  # --encoder-gelu (layers/linear_gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.linear_gelu(self.fc1, x))


class VisionEncoderLayer(nn.Module):
    """Pre-LN transformer layer; the global transformer's layers are tanh-gated."""

    def __init__(self, cfg: MllamaVisionConfig, is_gated: bool) -> None:
        super().__init__()
        self.is_gated = is_gated
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if is_gated:
            self.gate_attn = nn.Parameter(torch.full((1,), math.pi / 4))
            self.gate_ffn = nn.Parameter(torch.full((1,), math.pi / 4))

    def forward(self, x: torch.Tensor, pending: Pending, plan: VisionPlan,
                ops: AddNormOps) -> tuple[torch.Tensor, Pending]:
        # x: [N, L, D]; pending: the previous layer's (MLP output [N, L, D], gate) not yet
        # added -> (x + pending + gated attention output, this layer's pending MLP output)
        x, h = ops.add_layer_norm(self.input_layernorm, x, *pending)
        h = self.self_attn(h, plan)
        x, h = ops.add_layer_norm(self.post_attention_layernorm, x, h,
                                  self.gate_attn.tanh() if self.is_gated else None)
        return x, (self.mlp(h), self.gate_ffn.tanh() if self.is_gated else None)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig, num_layers: int, is_gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, is_gated) for _ in range(num_layers))


class AspectRatioEmbedding(nn.Module):
    """Gated per-tile embedding chosen by aspect-ratio id, added to every token of a tile."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.max_num_tiles = cfg.max_num_tiles
        self.hidden_size = cfg.hidden_size
        self.embedding = nn.Embedding(len(cfg.aspect_ratios) + 1,
                                      cfg.max_num_tiles * cfg.hidden_size)
        self.gate = nn.Parameter(torch.zeros(1))

    def per_tile(self, ar_ids: torch.Tensor) -> torch.Tensor:
        # ar_ids: [N] -> the gated embedding of every tile: [N, T, D]
        emb = self.embedding(ar_ids).view(-1, self.max_num_tiles, self.hidden_size)
        return emb * self.gate.tanh()

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        # x: [N, T, L, D]; ar_ids: [N]
        return x + self.per_tile(ar_ids)[:, :, None]


class PositionEmbedding(nn.Module):
    """``(1 - tanh g) * pos[P, D] + tanh g * tile_pos(ar_id)[T, P, D]`` (one gate g)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.max_num_tiles = cfg.max_num_tiles
        self.num_patches = cfg.num_patches
        self.hidden_size = cfg.hidden_size
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.hidden_size))
        self.tile_embedding = nn.Embedding(
            len(cfg.aspect_ratios) + 1, cfg.max_num_tiles * cfg.num_patches * cfg.hidden_size)

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        # x: [N, T, P, D]
        g = self.gate.tanh()
        x = x + (1 - g) * self.embedding.view(1, 1, self.num_patches, self.hidden_size)
        tile = self.tile_embedding(ar_ids).view(
            -1, self.max_num_tiles, self.num_patches, self.hidden_size)
        return x + g * tile


class MllamaVisionModel(nn.Module):
    """pixel_values ``[N, T, 3, S, S]`` -> features ``[N, T, P, vision_output_dim]``, or of the
    chosen tiles only. ``attention_plan`` names the token order and attention scheme
    (:data:`~edserve.models.mllama.vision_plan.VISION_PLANS`; "masked" is HF's as written);
    ``attention_kernel`` the grouped plan's mask-free attention
    (:data:`~edserve.models.mllama.vision_plan.VISION_KERNELS`, or "auto": by device)."""

    def __init__(self, cfg: MllamaVisionConfig, intermediate_semantics: str = "hf",
                 attention_plan: str = "grouped", attention_kernel: str = "auto") -> None:
        super().__init__()
        if attention_plan not in VISION_PLANS:
            raise ValueError(f"unknown vision attention plan {attention_plan!r}; choose from "
                             f"{sorted(VISION_PLANS)}")
        if attention_kernel != "auto" and attention_kernel not in VISION_KERNELS:
            raise ValueError(f"unknown vision attention kernel {attention_kernel!r}; choose "
                             f"from auto, {', '.join(sorted(VISION_KERNELS))}")
        self.cfg = cfg
        self.intermediate_semantics = intermediate_semantics
        self.attention_plan = attention_plan
        self.attention_kernel = attention_kernel
        D = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, D, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(D))
        self.gated_positional_embedding = PositionEmbedding(cfg)
        self.pre_tile_positional_embedding = AspectRatioEmbedding(cfg)
        self.post_tile_positional_embedding = AspectRatioEmbedding(cfg)
        self.layernorm_pre = nn.LayerNorm(D)  # default eps 1e-5, as HF
        self.layernorm_post = nn.LayerNorm(D)
        self.transformer = VisionEncoder(cfg, cfg.num_hidden_layers, is_gated=False)
        self.global_transformer = VisionEncoder(cfg, cfg.num_global_layers, is_gated=True)
        # The add + norm ops; None: chosen by the stream's device (add_norm_ops)
        self.add_norm: AddNormOps | None = None

    def embed(self, pixel_values: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        """Patch, class and position embeddings, pre-LN, pad to 8: ``[N, T * Ppad, D]``."""
        cfg = self.cfg
        N, T = pixel_values.shape[:2]
        D, P = cfg.hidden_size, cfg.num_patches
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.flatten(0, 1).to(w.device, w.dtype))
        x = x.flatten(2).transpose(1, 2).reshape(N, T, P - 1, D)  # [N, T, P-1, D]
        x = self.pre_tile_positional_embedding(x, ar_ids)
        cls = self.class_embedding.to(x.dtype).expand(N, T, 1, D)
        x = torch.cat([cls, x], dim=2)  # [N, T, P, D]
        x = self.gated_positional_embedding(x, ar_ids)
        x = self.layernorm_pre(x)
        return F.pad(x, (0, 0, 0, self.padded_len - P)).reshape(N, -1, D)  # pads after the LN

    def kernel_for(self, device: torch.device, dtype: torch.dtype) -> str:
        """The attention kernel for weights on ``device`` in ``dtype``: "auto" is, on CUDA in
        fp16 / bf16, the TMA-fed Triton kernel where the GPU has TMA (compute capability 9.0+:
        the 11B tower 2.5-3.8 % faster than on the pointer-load kernel on an H100, RESULTS.md
        wave 38) and reads the head dim (:func:`~edserve.kernels.tma_attention.tma_chunks`:
        the 11B's 80 = 64 + 16), else the pointer-load Triton kernel (any head dim; 80 without
        padding: ~3 % faster than SDPA's cuDNN on the H200, wave 24); SDPA off CUDA (no Triton
        on the CPU) and in fp32 (IEEE dots on CUDA cores). FlashAttention-3 before all of them
        where its library loads (``EDSERVE_FA3_LIB``) on a Hopper GPU in bf16: the 11B tower
        10-11 % faster than on the TMA kernel, H100, RESULTS.md wave 40."""
        if self.attention_kernel != "auto":
            return self.attention_kernel
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return "sdpa"
        head_dim = self.cfg.hidden_size // self.cfg.attention_heads
        if fa3_unsupported(device, dtype, head_dim) is None:
            return "fa3"
        return "tma" if has_tma(device) and tma_chunks(head_dim) else "triton"

    @property
    def padded_len(self) -> int:
        P = self.cfg.num_patches
        return P + (8 - P % 8) % 8

    def forward(self, pixel_values: torch.Tensor, ar_ids: torch.Tensor, ar_mask: torch.Tensor,
                tiles: list[int] | None = None) -> torch.Tensor:
        """Features of the flat (image, tile) indices ``tiles`` (``n * T + t``; None = all):
        ``[len(tiles), P, vision_output_dim]``, or ``[N, T, P, vision_output_dim]`` when None.
        ``ar_mask [N, T]`` is read on the host (keep it on the CPU to avoid a sync)."""
        cfg = self.cfg
        N, T = pixel_values.shape[:2]
        D, P, Ppad, K = cfg.hidden_size, cfg.num_patches, self.padded_len, \
            len(cfg.intermediate_layers_indices)
        # host-built indices first: their copies to the device wait on no queued work
        w = self.patch_embedding.weight
        plan = VISION_PLANS[self.attention_plan](ar_mask, P, Ppad, w.device,
                                                 self.kernel_for(w.device, w.dtype))
        keep = plan.plan_positions(list(range(N * T)) if tiles is None else tiles, P)  # [M]
        x = plan.to_plan(self.embed(pixel_values, ar_ids))  # [N, L, D] in plan order
        out = x.new_empty(keep.numel(), D * (1 + K))  # channel = D + d * K + k: d-major
        inter = out[:, D:].view(-1, D, K)

        saved = set(cfg.intermediate_layers_indices)

        def save(i: int, x: torch.Tensor, pending: Pending) -> tuple[torch.Tensor, Pending]:
            """Kept tokens of the full stream as intermediate(s) ``i`` (pending added first)."""
            if i not in saved:
                return x, pending
            x = add_pending(x, *pending)
            for k, j in enumerate(cfg.intermediate_layers_indices):
                if j == i:
                    inter[:, :, k] = x.view(-1, D).index_select(0, keep)
            return x, NO_PENDING

        ops = self.add_norm or add_norm_ops(x)
        pending = NO_PENDING
        for i, layer in enumerate(self.transformer.layers):
            if self.intermediate_semantics == "meta":
                x, pending = save(i, x, pending)  # input of layer i
            x, pending = layer(x, pending, plan, ops)
            if self.intermediate_semantics == "hf":
                x, pending = save(i, x, pending)  # output of layer i

        tile_emb = self.post_tile_positional_embedding.per_tile(ar_ids).reshape(N * T, D)
        _, x = ops.add_layer_norm(self.layernorm_post, x, *pending)
        x = x + tile_emb.index_select(0, plan.tile_index()).view_as(x)
        pending = NO_PENDING
        for layer in self.global_transformer.layers:
            x, pending = layer(x, pending, plan, ops)
        x = add_pending(x, *pending)
        out[:, :D] = x.view(-1, D).index_select(0, keep)
        return out.view(N, T, P, -1) if tiles is None else out.view(len(tiles), P, -1)
