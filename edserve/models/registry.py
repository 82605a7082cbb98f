"""Model registry: HF ``model_type`` -> a builder, imported lazily so the engine never imports a
concrete model. A builder takes a loaded checkpoint and returns ``(model, tokenizer)``."""

from __future__ import annotations

import importlib
from typing import Any

import torch

# model_type -> "module:function"
MODEL_REGISTRY: dict[str, str] = {
    "whisper": "edserve.models.whisper_loader:build_whisper",
    "mllama": "edserve.models.mllama.loader:build_mllama",
}


def build_model(checkpoint: Any, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    model_type = checkpoint.config.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"{checkpoint.folder}: unsupported model_type {model_type!r}; "
                         f"supported: {sorted(MODEL_REGISTRY)}")
    module, fn = MODEL_REGISTRY[model_type].split(":")
    return getattr(importlib.import_module(module), fn)(checkpoint, dtype, device)
