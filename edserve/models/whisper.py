"""Whisper (any size: tiny ... large-v3) in plain torch, with HF parameter names.

The encoder runs batched over the requests admitted in a step (fused SDPA, no KV cache). The
decoder's self- and cross-attention go through :class:`Attention`, i.e. the paged KV pool: each
decoder layer ``i`` uses KV-pool layer ``i`` for both its cross K/V (the row's encoder region) and
its self K/V (the decoder region). Cross K/V are projected once, at prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edserve.engine.forward_batch import ForwardBatch
from edserve.layers.attention.base import Attention


@dataclass(frozen=True)
class WhisperConfig:
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int  # encoder frames after the stride-2 conv: 1500
    max_target_positions: int  # decoder positions: 448
    vocab_size: int
    eos_token_id: int = 50256
    decoder_start_token_id: int = 50257

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> WhisperConfig:
        act = cfg.get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported Whisper activation {act!r} (only gelu)")
        if cfg.get("scale_embedding", False):
            raise ValueError("Whisper checkpoints with scale_embedding=True are not supported")
        return cls(**{f: cfg[f] for f in (
            "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
            "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim", "num_mel_bins",
            "max_source_positions", "max_target_positions", "vocab_size")},
            eos_token_id=cfg.get("eos_token_id", 50256),
            decoder_start_token_id=cfg.get("decoder_start_token_id", 50257))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads


class _SelfAttentionProj(nn.Module):
    """q/k/v/out projections with HF names (k has no bias)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.self_attn = _SelfAttentionProj(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, S, d]
        N, S, d = x.shape
        h = self.self_attn_layer_norm(x)
        a = self.self_attn

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(N, S, self.num_heads, -1).transpose(1, 2)  # [N, H, S, hd]

        o = F.scaled_dot_product_attention(heads(a.q_proj(h)), heads(a.k_proj(h)),
                                           heads(a.v_proj(h)))
        x = x + a.out_proj(o.transpose(1, 2).reshape(N, S, d))
        h = self.final_layer_norm(x)
        return x + self.fc2(F.gelu(self.fc1(h)))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: [N, n_mels, 2 * max_source_positions] -> [N, max_source_positions, d]
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig, layer_id: int) -> None:
        super().__init__()
        d, H = cfg.d_model, cfg.decoder_attention_heads
        self.num_heads = H
        self.head_dim = d // H
        scaling = self.head_dim**-0.5
        self.self_attn = _SelfAttentionProj(d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = _SelfAttentionProj(d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.self_site = Attention(layer_id, H, H, self.head_dim, scaling, is_cross=False)
        self.cross_site = Attention(layer_id, H, H, self.head_dim, scaling, is_cross=True)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], self.num_heads, self.head_dim)  # [T, H, hd]

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                encoder_states: torch.Tensor | None) -> torch.Tensor:
        # x: [T, d]; encoder_states: [sum encoder_lens, d] at prefill, else None
        T, d = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        o = self.self_site(self._heads(a.q_proj(h)), self._heads(a.k_proj(h)),
                           self._heads(a.v_proj(h)), batch)
        x = x + a.out_proj(o.reshape(T, d))

        c = self.encoder_attn
        h = self.encoder_attn_layer_norm(x)
        k = v = None
        if encoder_states is not None:  # prefill: project the encoder output once
            k = self._heads(c.k_proj(encoder_states))
            v = self._heads(c.v_proj(encoder_states))
        o = self.cross_site(self._heads(c.q_proj(h)), k, v, batch)
        x = x + c.out_proj(o.reshape(T, d))

        h = self.final_layer_norm(x)
        return x + self.fc2(F.gelu(self.fc1(h)))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(cfg, i) for i in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class _Inner(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)


class WhisperForConditionalGeneration(nn.Module):
    """The engine-facing model: ``encode`` + ``forward`` + ``compute_logits``."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Inner(cfg)

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

    def encoder_len(self, encoder_input: Any) -> int:
        """Encoder tokens for one request; validates the log-mel (raises ValueError)."""
        if encoder_input is None:
            return 0
        expected = (self.config.num_mel_bins, 2 * self.config.max_source_positions)
        if not torch.is_tensor(encoder_input) or tuple(encoder_input.shape) != expected:
            shape = list(encoder_input.shape) if torch.is_tensor(encoder_input) \
                else type(encoder_input).__name__
            raise ValueError(f"Whisper expects a log-mel tensor of shape {list(expected)}, "
                             f"got {shape}")
        if not torch.isfinite(encoder_input).all():
            raise ValueError("Whisper log-mel contains NaN or infinite values")
        return self.config.max_source_positions

    def encode(self, encoder_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mels ``[n_mels, 3000]`` per request -> encoder states ``[1500, d]`` per request."""
        if not encoder_inputs:
            return []
        p = next(self.parameters())
        for m in encoder_inputs:
            self.encoder_len(m)
        mel = torch.stack([m.to(device=p.device, dtype=p.dtype) for m in encoder_inputs])
        return list(self.model.encoder(mel).unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                encoder_states: torch.Tensor | None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, d] (final layer norm applied)."""
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for layer in dec.layers:
            x = layer(x, batch, encoder_states)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, d] -> [N, vocab] (output projection tied to the token embedding)
        return F.linear(hidden, self.model.decoder.embed_tokens.weight)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors; ``proj_out.weight`` is tied to the token embedding."""
        sd = {k: v for k, v in state_dict.items() if k != "proj_out.weight"}
        missing, unexpected = self.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"Whisper weights do not match the config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
