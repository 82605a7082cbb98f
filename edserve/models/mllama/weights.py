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

import torch
from safetensors import safe_open

from edserve.models.mllama.config import MllamaConfig
from edserve.models.mllama.model import MllamaModel


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
    """Copy HF-named tensors into ``model``; every parameter must be covered exactly once."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected = []
    with torch.no_grad():
        for hf_name, t in tensors.items():
            name = hf_to_edserve_name(hf_name)
            if name not in params:
                unexpected.append(hf_name)
                continue
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"{hf_name}: shape {tuple(t.shape)} != expected {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:8]} ({len(missing)}), "
                         f"unexpected {unexpected[:8]} ({len(unexpected)})")


def load_mllama(folder: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", **switches: str) -> MllamaModel:
    """Build :class:`MllamaModel` from an HF folder; ``switches`` are the config's parity
    switches (``vision_intermediate_semantics``, ``cross_attention_empty_rows``)."""
    folder = Path(folder)
    with open(folder / "config.json") as f:
        cfg = MllamaConfig.from_hf(json.load(f), **switches)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with torch.device("meta"):
        model = MllamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.language_model.rotary_emb.__init__(cfg.text.rope, cfg.text.head_dim)  # buffers
    model.language_model.rotary_emb.to(device)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as sf:
            for key in sf.keys():
                tensors[key] = sf.get_tensor(key)
    load_state_dict(model, tensors)
    return model.eval()
