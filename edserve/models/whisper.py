"""Whisper (any size: tiny ... large-v3) in plain torch, with HF parameter names except for
the fused projections.

The encoder (:mod:`edserve.models.whisper_encoder`) runs batched over the requests admitted in
a step. The decoder's self- and cross-attention go through
:class:`Attention`, i.e. the paged KV pool: each decoder layer ``i`` uses KV-pool layer ``i`` for
both its cross K/V (the row's encoder region) and its self K/V (the decoder region).

Fused projections (one GEMM each), filled from the HF-named checkpoint at load time by
:func:`edserve.models.weights.fused.load_hf_tensors`:
  * ``self_attn.qkv_proj`` ``[3d, d]`` (encoder and decoder self-attention; k's bias rows 0);
  * ``decoder.cross_kv_proj`` ``[L * 2d, d]``: every decoder layer's cross k/v, so the encoder
    output is projected for all layers at once at prefill (the cross K/V are projected once
    per request and then live in the pool).

As in the encoder, every residual add of the decoder is fused into the LayerNorm that reads the
sum next (:mod:`edserve.layers.add_norm`: one Triton kernel on CUDA, bit-identical torch ops
elsewhere): a layer takes the stream and the previous layer's MLP output still to be added, and
the final LayerNorm adds the last one. On the H200 at 64 decoding rows the separate adds and
norms were 194 kernels per step (benchmarks/RESULTS.md, wave 9).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edserve.layers.add_norm import AddNormOps, add_norm_ops
from edserve.layers.attention.base import Attention
from edserve.layers.forward_batch import ForwardBatch
from edserve.layers.linear_gelu import LinearGelu, linear_gelu_exact
from edserve.models.encoder_graphs import EncoderGraphs
from edserve.models.vocab_projection import pad_rows, vocab_logits
from edserve.models.weights.fused import FusedLinear, load_hf_tensors
from edserve.models.whisper_config import WhisperConfig
from edserve.models.whisper_encoder import SelfAttention, WhisperEncoder
from edserve.models.whisper_inputs import WhisperInputs

__all__ = ["WhisperConfig", "WhisperForConditionalGeneration"]


# Largest cross K/V projection output materialised at once at prefill (bytes); above it the
# layers are projected in groups (large-v3, 8 clips, bf16: 2 GEMMs of 16 layers).
CROSS_KV_CHUNK_BYTES = 1 << 30


class _CrossAttention(nn.Module):
    """Cross-attention's q and out projections; its k/v live in
    :attr:`WhisperDecoder.cross_kv_proj` (all layers, one GEMM at prefill)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig, layer_id: int) -> None:
        super().__init__()
        d, H = cfg.d_model, cfg.decoder_attention_heads
        self.num_heads = H
        self.head_dim = d // H
        scaling = self.head_dim**-0.5
        self.self_attn = SelfAttention(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = _CrossAttention(d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.mlp_gelu: LinearGelu = linear_gelu_exact  # --decoder-gelu (layers/linear_gelu)
        self.self_site = Attention(layer_id, H, H, self.head_dim, scaling, is_cross=False)
        self.cross_site = Attention(layer_id, H, H, self.head_dim, scaling, is_cross=True)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, batch: ForwardBatch,
                cross_kv: tuple[torch.Tensor, torch.Tensor] | None,
                ops: AddNormOps) -> tuple[torch.Tensor, torch.Tensor]:
        # x, delta: [T, d] (delta: the previous layer's MLP output, not yet added; None for the
        # first layer) -> (x + delta + attention outputs, this layer's MLP output), [T, d].
        # cross_kv: this layer's projected encoder k, v [sum encoder_lens, H, hd] at prefill
        # (written to the pool by the cross site), else None
        T, d = x.shape
        a = self.self_attn
        x, h = ops.add_layer_norm(self.self_attn_layer_norm, x, delta)
        qkv = a.qkv_proj(h)  # [T, 3d]
        q, k, v = qkv.view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, hd]
        o = self.self_site(q, k, v, batch)  # [T, H, hd]
        x, h = ops.add_layer_norm(self.encoder_attn_layer_norm, x, a.out_proj(o.reshape(T, d)))

        c = self.encoder_attn
        q = c.q_proj(h).view(T, self.num_heads, self.head_dim)
        k, v = cross_kv if cross_kv is not None else (None, None)
        o = self.cross_site(q, k, v, batch)  # [T, H, hd]
        x, h = ops.add_layer_norm(self.final_layer_norm, x, c.out_proj(o.reshape(T, d)))
        return x, self.fc2(self.mlp_gelu(self.fc1, h))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d, L = cfg.d_model, cfg.decoder_layers
        self.num_heads = cfg.decoder_attention_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, d)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, i) for i in range(L))
        self.layer_norm = nn.LayerNorm(d)
        # Every layer's cross-attention k/v stacked: rows (layer, k|v) -> [L * 2d, d], filled
        # from HF's layers.{i}.encoder_attn.{k,v}_proj (k has no bias: zero bias rows).
        cross = [f"layers.{i}.encoder_attn.{p}_proj" for i in range(L) for p in "kv"]
        self.cross_kv_proj = FusedLinear(d, [(c, d) for c in cross], no_bias=cross[::2])
        # Set by a post-load transform (``--quantization int8``): one module per layer
        # computing that layer's ``[S, 2d]`` cross k|v, used instead of the stacked GEMM
        # (which the transform then drops).
        self.cross_kv_layers: nn.ModuleList | None = None

    def cross_kv(self, enc: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Cross K/V of every layer, in layer order: enc ``[S, d]`` -> (k, v) ``[S, H, hd]``.

        One GEMM projects ``enc`` for all layers at once (groups of layers only when the output
        would exceed :data:`CROSS_KV_CHUNK_BYTES`); k/v are strided views of its output."""
        S, d = enc.shape
        L, H = len(self.layers), self.num_heads
        if self.cross_kv_layers is not None:
            for proj in self.cross_kv_layers:
                y = proj(enc).view(S, 2, H, d // H)  # [S, 2, H, hd]
                yield y[:, 0], y[:, 1]
            return
        group = max(1, min(L, CROSS_KV_CHUNK_BYTES // max(1, S * 2 * d * enc.element_size())))
        w, b = self.cross_kv_proj.weight, self.cross_kv_proj.bias  # [L * 2d, d], [L * 2d]
        for first in range(0, L, group):
            n = min(group, L - first)
            rows = slice(first * 2 * d, (first + n) * 2 * d)
            y = F.linear(enc, w[rows], b[rows]).view(S, n, 2, H, d // H)  # [S, n, 2, H, hd]
            for i in range(n):
                yield y[:, i, 0], y[:, i, 1]
            del y


class _Inner(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)


class WhisperForConditionalGeneration(nn.Module):
    """The engine-facing model: ``encode`` + ``forward`` + ``compute_logits``."""

    model_type = "whisper"  # the registry key (edserve.models.registry)

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Inner(cfg)
        self.encoder_graphs: EncoderGraphs | None = None  # capture_encoder_graphs
        # The decoder's add + norm ops; None: chosen by the stream's device (add_norm_ops)
        self.add_norm: AddNormOps | None = None
        # encoder inputs: checks, page-locked staging (CUDA), the step's upload / log-mels
        self.inputs = WhisperInputs(cfg.num_mel_bins, 2 * cfg.max_source_positions)
        self.vocab_rows: torch.Tensor | None = None  # [P, d] padded embedding (align_vocabulary)

    # Sizes the engine needs to lay out the KV pool.
    @property
    def num_kv_layers(self) -> int:
        return self.config.decoder_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.decoder_attention_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def max_encoder_len(self) -> int:
        return self.config.max_source_positions

    @property
    def max_decoder_len(self) -> int:
        return self.config.max_target_positions

    @property
    def input_vocab_size(self) -> int:
        """Token ids a prompt may hold: ``0 .. input_vocab_size - 1`` (embedding rows)."""
        return self.config.vocab_size

    def encoder_len(self, encoder_input: Any) -> int:
        """Encoder tokens for one request; validates the input (raises ValueError): a log-mel
        or a short clip's samples (:class:`~edserve.models.whisper_inputs.WhisperInputs`).

        Shape and dtype only for a device tensor (reading its values would make the host wait
        for the device); host values are also checked for NaN/inf (host work, no sync).
        Audio is refused earlier when it has non-finite samples (``edserve.audio``)."""
        if encoder_input is None:
            return 0
        self.inputs.check(encoder_input)
        return self.config.max_source_positions

    def stage_encoder_input(self, x: Any) -> Any:
        """A validated input, ready for a fast upload (any thread, at submission): on CUDA a
        page-locked copy (:meth:`WhisperInputs.stage`), else ``x`` (a CompactMel window
        written out as a tensor)."""
        return self.inputs.stage(x, next(self.parameters()).device)

    def warm_encoder(self, max_bs: int) -> None:
        """``--encoder-warmup-max-bs`` (:meth:`Engine.warm_up`): the encoder once at every batch
        size 1..``max_bs`` on zero log-mels, so cuDNN/cuBLAS make their per-shape choices for
        the calling thread now, not while serving."""
        p = next(self.parameters())
        mel = torch.zeros(self.config.num_mel_bins, 2 * self.config.max_source_positions,
                          device=p.device)
        self.inputs.filters(p.device)  # the step log-mels' filterbank, uploaded now
        with torch.inference_mode():
            for n in range(1, max_bs + 1):
                self.encode([mel] * n)

    def encode(self, encoder_inputs: list[Any]) -> list[torch.Tensor]:
        """Log-mels ``[n_mels, 3000]`` (or PCM windows, whose log-mels are computed here, on
        the device, together) per request -> encoder states ``[1500, d]`` per request.

        No host<->device sync: inputs are checked by shape only (values were checked at
        submission, :meth:`encoder_len`) and host inputs go up by page-locked,
        non-blocking copies; the model dtype conversion runs on the device."""
        if not encoder_inputs:
            return []
        p = next(self.parameters())
        mel = self.inputs.to_device(encoder_inputs, p.device)  # [N, n_mels, 3000]
        graphs = self.encoder_graphs
        out = graphs.run(mel) if graphs is not None else None  # [N, 1500, d] or None
        enc, dec = self.model.encoder, self.model.decoder
        if out is None:  # in the encoder's own dtype (--encoder-dtype bfloat16)
            out = enc(mel.to(enc.conv1.weight.dtype))
        return list(out.to(dec.layer_norm.weight.dtype).unbind(0))  # N x [1500, d], decoder's

    def compile_encoder(self) -> None:
        """``--compile-encoder``: the encoder layers run through one ``torch.compile``d
        function (:meth:`WhisperEncoder.compile_layers`)."""
        self.model.encoder.compile_layers()

    def capture_encoder_graphs(self, max_bs: int) -> None:
        """``--encoder-cuda-graph-max-bs``: :class:`EncoderGraphs` of the encoder (as it is now,
        compiled or not) for batches up to ``max_bs`` (CUDA)."""
        p = next(self.parameters())
        self.encoder_graphs = EncoderGraphs(
            self.model.encoder, max_bs,
            (self.config.num_mel_bins, 2 * self.config.max_source_positions),
            self.model.encoder.conv1.weight.dtype, p.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                encoder_states: torch.Tensor | None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, d] (final layer norm applied)."""
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        # prefill: the encoder output projected for every layer (one GEMM), consumed in order
        cross = dec.cross_kv(encoder_states) if encoder_states is not None else None
        ops = self.add_norm or add_norm_ops(x)
        delta = None  # [T, d]: the last layer's MLP output, added by the next norm
        for layer in dec.layers:
            x, delta = layer(x, delta, batch, next(cross) if cross is not None else None, ops)
        return ops.add_layer_norm(dec.layer_norm, x, delta)[1]

    def write_cross_kv(self, encoder_states: torch.Tensor, batch: ForwardBatch) -> None:
        """A prefill's cross K/V without the decoder pass: ``encoder_states``
        ``[sum encoder_lens, d]`` projected for every layer and written to the pool, as
        :meth:`forward` does on its way (the prompt then runs as decode steps:
        :mod:`edserve.engine.prompt_graphs`)."""
        dec = self.model.decoder
        for layer, (k, v) in zip(dec.layers, dec.cross_kv(encoder_states), strict=True):
            batch.attn_backend.write_cross(layer.cross_site, k, v, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, d] -> [N, vocab] (output projection tied to the token embedding; rows
        # may be strided on CUDA: see models/vocab_projection.py)
        return vocab_logits(hidden, self.model.decoder.embed_tokens.weight, self.vocab_rows)

    def align_vocabulary(self) -> None:
        """CUDA: an unaligned vocabulary's embedding becomes the first rows of a zero-padded
        buffer, the same memory, which ``compute_logits`` multiplies by (see
        :mod:`edserve.models.vocab_projection`). Call once the weights are final."""
        emb = self.model.decoder.embed_tokens
        buf = pad_rows(emb.weight.detach()) if emb.weight.is_cuda else None
        if buf is not None:
            emb.weight = nn.Parameter(buf[:emb.num_embeddings], requires_grad=False)
        self.vocab_rows = buf

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and the cross k/v into their stacked weights
        (see :mod:`edserve.models.weights.fused`); ``proj_out.weight`` is tied to the token
        embedding and skipped."""
        try:
            load_hf_tensors(self, state_dict, ignore=["proj_out.weight"])
        except ValueError as e:
            raise ValueError(f"Whisper weights do not match the config: {e}") from None
