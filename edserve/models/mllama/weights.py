"""Load Mllama from an HF folder: ``config.json`` + ``*.safetensors`` (HF parameter names).

Both checkpoint layouts are accepted:
  * transformers >= 5 (``model.vision_model.*``, ``model.language_model.*``,
    ``model.multi_modal_projector.*``, ``lm_head.*``);
  * transformers 4.x / the published 11B checkpoints (``vision_model.*``,
    ``language_model.model.*``, ``language_model.lm_head.*``, ``multi_modal_projector.*``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from edserve.models.mllama.config import MllamaConfig
from edserve.models.mllama.model import MllamaModel
from edserve.models.mllama.rope import rope_inv_freq
from edserve.models.weights.fused import load_hf_tensors


def hf_to_edserve_name(name: str) -> str:
    """Map an HF parameter name (either layout) to this package's module names."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("language_model.model."):
        return "language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


def load_state_dict(model: MllamaModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into ``model``; every parameter row must be covered exactly once.

    Fused projections (``qkv_proj``, ``kv_proj``, ``gate_up_proj``) are filled from HF's
    separate ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` tensors here, at load
    time (see :mod:`edserve.models.weights.fused`); a fused tensor under the model's own name
    (a :class:`MllamaModel` ``state_dict()``) is accepted as well."""
    load_hf_tensors(model, tensors, rename=hf_to_edserve_name)


def build_from_state_dict(config: dict, tensors: dict[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", **switches: Any) -> MllamaModel:
    """Build :class:`MllamaModel` from an HF config dict and HF-named tensors; ``switches``
    set the config fields HF lacks (``vision_intermediate_semantics``,
    ``cross_attention_empty_rows``, ``max_images``)."""
    cfg = MllamaConfig.from_hf(config, **switches)
    with torch.device("meta"):
        model = MllamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    rope = model.language_model.rotary_emb  # non-persistent buffer: recompute on the device
    rope.inv_freq = rope_inv_freq(cfg.text.rope, cfg.text.head_dim).to(device)
    load_state_dict(model, tensors)
    return model.eval()


def load_mllama(folder: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", **switches: Any) -> MllamaModel:
    """Load an HF folder (``config.json`` + ``*.safetensors``); see
    :func:`build_from_state_dict`."""
    folder = Path(folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as sf:
            for key in sf.keys():
                tensors[key] = sf.get_tensor(key)
    return build_from_state_dict(config, tensors, dtype, device, **switches)
