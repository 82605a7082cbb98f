"""An HF model folder: ``config.json`` + ``model.safetensors`` (or sharded, with an index).

Tensors are returned as stored (names and dtypes); tied weights the file omits (such as
Whisper's ``proj_out.weight``) stay omitted, as HF's own ``from_pretrained`` expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from edserve.models.weights.errors import WeightsError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise WeightsError(f"{path}: missing safetensors file")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from e


def _load_sharded(index_path: Path) -> dict[str, torch.Tensor]:
    """Load every shard named by the index; each tensor must sit in the shard the index says."""
    weight_map = _read_json(index_path, "sharded checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index_path}: no 'weight_map' of tensor name -> shard file")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        tensors = _load_safetensors(shard_path)
        expected = {name for name, file in weight_map.items() if file == shard}
        if expected - tensors.keys():
            missing = sorted(expected - tensors.keys())[:5]
            raise WeightsError(f"{shard_path}: lacks tensors the index lists: {missing}")
        state_dict.update({name: tensors[name] for name in expected})
    return state_dict


def read_hf_folder(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``(config, state_dict)`` from an HF folder; :class:`WeightsError` names the file.

    Weights come from ``model.safetensors`` when present, else from the shards listed in
    ``model.safetensors.index.json``.
    """
    folder = Path(folder)
    config = _read_json(folder / "config.json", "model config")
    if (folder / SINGLE_FILE).exists():
        state_dict = _load_safetensors(folder / SINGLE_FILE)
    elif (folder / INDEX_FILE).exists():
        state_dict = _load_sharded(folder / INDEX_FILE)
    else:
        raise WeightsError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    if not state_dict:
        raise WeightsError(f"{folder}: the checkpoint holds no tensors")
    return config, state_dict
