"""Whisper's audio encoder: two convolutions, positions, ``encoder_layers`` transformer layers.

It runs batched over the requests admitted in a step (one stacked batch in the model's dtype,
no KV cache; the attention is ``--encoder-attention``'s form,
:mod:`edserve.layers.encoder_attention`). The residual stream is kept **token-major and
contiguous** (``[N, S, d]``, stride ``(S d, d, 1)``): the convolutions produce ``[N, d, S]``,
and adding the positions to its transposed view would give a tensor laid out ``[N, d, S]`` in
memory; every residual add then kept that layout (TensorIterator follows its first operand)
and every layer norm copied it to a contiguous one (on the H200 at batch 16 that was 14 ms of
strided adds and 13 ms of copies in a 114 ms prefill step). The first add now writes into a
contiguous buffer.

Every residual add is fused into the LayerNorm that follows it (issue 19: on the H200 the
separate adds and norms were 8 ms of a 83.5 ms batch-16 prefill step): layer ``i`` takes the
stream and the MLP output of layer ``i - 1`` still to be added (``delta``), and returns the
stream after its attention add and its own MLP output; the encoder's final LayerNorm adds the
last one. The adds and norms are :mod:`edserve.layers.add_norm`'s ops: one Triton kernel per
add + norm on CUDA, the eager torch ops elsewhere (bit-identical to the unfused layer on CPU).

``--compile-encoder`` (:meth:`WhisperEncoder.compile_layers`) runs every layer through one
``torch.compile``d function (inductor fuses bias + GELU and residual add + layer norm into
Triton kernels on CUDA; the compiled layer runs the torch ops and adds its own MLP output,
:func:`run_unfused_layer`). The layers share one graph: the function takes the layer as an
argument and dynamo treats its parameters as inputs (``inline_inbuilt_nn_modules``), so layer
``i`` does not recompile; the batch dimension is marked dynamic, so one graph serves every
batch size >= 2 (batch 1 gets its own). The first prefill pays the compilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edserve.layers.add_norm import TORCH_ADD_NORM, AddNormOps, add_norm_ops
from edserve.layers.encoder_attention import Attend, sdpa_attend
from edserve.layers.linear_gelu import LinearGelu, linear_gelu_exact
from edserve.models.weights.fused import FusedLinear
from edserve.models.whisper_config import WhisperConfig


class SelfAttention(nn.Module):
    """q/k/v as one GEMM (``qkv_proj`` ``[3d, d]``, filled from HF's ``q_proj``/``k_proj``/
    ``v_proj``; k has no bias, so its bias rows are zero) and ``out_proj``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv_proj = FusedLinear(d, [("q_proj", d), ("k_proj", d), ("v_proj", d)],
                                    no_bias=["k_proj"])
        self.out_proj = nn.Linear(d, d)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.self_attn = SelfAttention(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.linear_gelu: LinearGelu = linear_gelu_exact  # --encoder-gelu (layers/linear_gelu)
        self.attend: Attend = sdpa_attend  # --encoder-attention (layers/encoder_attention)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                ops: AddNormOps) -> tuple[torch.Tensor, torch.Tensor]:
        # x, delta: [N, S, d] (delta: the previous layer's MLP output, not yet added; None for
        # the first layer) -> (x + delta + attention output, this layer's MLP output), [N, S, d]
        N, S, d = x.shape
        a = self.self_attn
        x, h = ops.add_layer_norm(self.self_attn_layer_norm, x, delta)
        qkv = a.qkv_proj(h)  # [N, S, 3d]
        q, k, v = qkv.view(N, S, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # [N, H, S, hd]
        o = self.attend(q, k, v)  # [N, S, H, hd]
        x, h = ops.add_layer_norm(self.final_layer_norm, x, a.out_proj(o.reshape(N, S, d)))
        return x, self.fc2(self.linear_gelu(self.fc1, h))


def run_unfused_layer(layer: WhisperEncoderLayer, x: torch.Tensor) -> torch.Tensor:
    """One layer with the torch ops, its MLP output added: ``x -> x`` (the function
    ``--compile-encoder`` compiles once for all layers, see module doc)."""
    x, delta = layer(x, None, TORCH_ADD_NORM)
    return x + delta


LayerRunner = Callable[[WhisperEncoderLayer, torch.Tensor, torch.Tensor | None, AddNormOps],
                       tuple[torch.Tensor, torch.Tensor | None]]


def _run_layer(layer: WhisperEncoderLayer, x: torch.Tensor, delta: torch.Tensor | None,
               ops: AddNormOps) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager layer: ``(x, pending delta) -> (x, pending delta)``."""
    return layer(x, delta, ops)


def _compiled_runner(backend: Any) -> LayerRunner:
    compiled = torch.compile(run_unfused_layer, fullgraph=True, backend=backend)

    def run(layer: WhisperEncoderLayer, x: torch.Tensor, delta: torch.Tensor | None,
            ops: AddNormOps) -> tuple[torch.Tensor, None]:
        # delta is None: every compiled layer adds its own MLP output
        return compiled(layer, x), None
    return run


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        # How each layer is run: the eager call, or the compiled function (compile_layers).
        self.run_layer: LayerRunner = _run_layer
        self.compiled = False
        # The add + norm ops; None: chosen by the stream's device (add_norm_ops)
        self.add_norm: AddNormOps | None = None

    def compile_layers(self, backend: Any = "inductor") -> None:
        """Run the layers through one ``torch.compile``d function (``--compile-encoder``;
        ``backend``: any ``torch.compile`` backend, tests count graphs with their own)."""
        self.run_layer = _compiled_runner(backend)
        self.compiled = True

    def uncompile_layers(self) -> None:
        """Back to the eager layers."""
        self.run_layer, self.compiled = _run_layer, False

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: [N, n_mels, 2 * max_source_positions] -> [N, max_source_positions, d]
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x))  # [N, d, S]
        N, d, S = x.shape
        # token-major and contiguous from here on (module doc): one kernel, the positions added
        pos = self.embed_positions.weight[:S]  # [S, d]
        if torch.is_grad_enabled() and (x.requires_grad or pos.requires_grad):
            # out= is not differentiable (callers that take gradients): one more copy
            stream = (x.transpose(1, 2) + pos).contiguous()  # [N, S, d]
        else:
            stream = torch.empty((N, S, d), dtype=x.dtype, device=x.device)  # [N, S, d]
            torch.add(x.transpose(1, 2), pos, out=stream)
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(stream, 0)  # one graph for every batch size >= 2
        ops = self.add_norm or add_norm_ops(stream)
        delta = None  # [N, S, d]: the last layer's MLP output, added by the next norm
        for layer in self.layers:
            stream, delta = self.run_layer(layer, stream, delta, ops)
        return ops.add_layer_norm(self.layer_norm, stream, delta)[1]
