"""Integer index arguments: coercion to 1-D int64 and short previews for error messages."""

from __future__ import annotations

import torch


def as_index(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """1-D int64 copy of an integer tensor (any shape) on ``device``; no device read."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t.reshape(-1).to(device=device, dtype=torch.int64)


def preview(t: torch.Tensor, n: int = 8) -> str:
    """The first ``n`` values of ``t`` as text, with ``...`` when there are more."""
    vals = t[:n].tolist()
    return f"{vals}{' ...' if t.numel() > n else ''}"
