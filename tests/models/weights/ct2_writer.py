"""A minimal CTranslate2 ``model.bin`` writer (binary version 6), for building test files."""

from __future__ import annotations

import struct
from pathlib import Path

import torch

DTYPE_CODES = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3,
               torch.float16: 4, torch.bfloat16: 5}


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def ct2_bytes(variables: dict[str, torch.Tensor], aliases: dict[str, str] | None = None,
              version: int = 6, spec: str = "WhisperSpec", revision: int = 3) -> bytes:
    parts = [struct.pack("<I", version), _string(spec)]
    parts.append(struct.pack("<II", revision, len(variables)))
    for name, t in variables.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts += [_string(name), struct.pack(f"<B{t.dim()}I", t.dim(), *t.shape),
                  struct.pack("<BI", DTYPE_CODES[t.dtype], len(raw)), raw]
    aliases = aliases or {}
    parts.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        parts += [_string(alias), _string(target)]
    return b"".join(parts)


def write_ct2_folder(folder: Path, model_bin: bytes, config_json: str = "{}") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_bytes(model_bin)
    (folder / "config.json").write_text(config_json)
    return folder
