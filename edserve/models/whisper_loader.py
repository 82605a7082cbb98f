"""Build a Whisper model + tokenizer from a loaded checkpoint (HF or CTranslate2 folder)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.tokenizer import WhisperTokenizer


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    """``nn.init.normal_`` skips meta tensors while the model is built on the meta device: its
    meta implementation imports ``torch._dynamo`` (~1.3 s of CLI start-up) and meta tensors
    hold no values anyway. Real tensors (another thread's modules) are still initialised."""
    normal = torch.nn.init.normal_

    def skip_meta(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else normal(tensor, *args, **kwargs)

    torch.nn.init.normal_ = skip_meta
    try:
        yield
    finally:
        torch.nn.init.normal_ = normal


def build_whisper(checkpoint: Any, dtype: torch.dtype,
                  device: torch.device) -> tuple[WhisperForConditionalGeneration, Any]:
    cfg = WhisperConfig.from_hf(checkpoint.config)
    with torch.device("meta"), _skip_init():
        model = WhisperForConditionalGeneration(cfg)
    # to_empty() without its meta-tensor empty_like (which imports sympy: ~0.7 s of start-up)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.load_weights({k: v.to(device=device, dtype=dtype)
                        for k, v in checkpoint.state_dict.items()})
    model = model.to(dtype).eval()
    model.align_vocabulary()
    tokenizer = WhisperTokenizer.from_file(checkpoint.tokenizer_path, vocab_size=cfg.vocab_size)
    return model, tokenizer
