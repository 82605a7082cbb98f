"""Build a Whisper model + tokenizer from a loaded checkpoint (HF or CTranslate2 folder)."""

from __future__ import annotations

from typing import Any

import torch

from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.tokenizer import WhisperTokenizer


def build_whisper(checkpoint: Any, dtype: torch.dtype,
                  device: torch.device) -> tuple[WhisperForConditionalGeneration, Any]:
    cfg = WhisperConfig.from_hf(checkpoint.config)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(cfg)
    model = model.to_empty(device=device)
    model.load_weights({k: v.to(device=device, dtype=dtype)
                        for k, v in checkpoint.state_dict.items()})
    model = model.to(dtype).eval()
    tokenizer = WhisperTokenizer.from_file(checkpoint.tokenizer_path, vocab_size=cfg.vocab_size)
    return model, tokenizer
