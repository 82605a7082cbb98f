"""Row-wise ops of a decoder layer (RMSNorm, SiLU-and-multiply, rotary embedding), chosen with
the attention ops.

``elementwise_ops(batch)`` returns the op set registered under the name of the batch's attention
ops (``batch.attn_backend.ops.name``): "triton" runs the fused kernels of
:mod:`edserve.kernels.norm_act` and :mod:`edserve.kernels.rope` (CUDA; the CPU interpreter in
tests), anything else the torch reference below. Models call ``ops.rms_norm(x, weight, eps)``,
``ops.silu_mul(g, u)`` and ``ops.rope(x, cos, sin)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, in fp32, rounded to x's
    dtype before the weight (as HF's LlamaRMSNorm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def silu_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout. x: [T, H, D]; cos, sin: [T, 1, D]."""
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class ElementwiseOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_OPS = ElementwiseOps("torch", rms_norm_torch, silu_mul_torch, rope_torch)


@functools.cache
def _triton_ops() -> ElementwiseOps:
    from edserve.kernels.norm_act import rms_norm, silu_mul
    from edserve.kernels.rope import rope

    return ElementwiseOps("triton", rms_norm, silu_mul, rope)


ELEMENTWISE_REGISTRY: dict[str, Callable[[], ElementwiseOps]] = {
    "torch": lambda: TORCH_OPS,
    "triton": _triton_ops,
}


def elementwise_ops(batch: Any) -> ElementwiseOps:
    """The op set matching ``batch``'s attention ops (torch when it names none registered)."""
    name = getattr(getattr(getattr(batch, "attn_backend", None), "ops", None), "name", "torch")
    return ELEMENTWISE_REGISTRY.get(name, ELEMENTWISE_REGISTRY["torch"])()
