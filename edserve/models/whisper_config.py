"""Whisper's model shape (HF ``config.json`` fields the model uses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
