"""Residual add + LayerNorm of the encoders (Whisper, Mllama vision): torch, or one Triton kernel.

A pre-LN encoder layer ends with ``x = x + delta`` (``x + tanh(g) * delta`` in Mllama's gated
global layers), and the next thing that reads ``x`` is a LayerNorm. The encoders therefore
carry the sublayer output as *pending* and let the next norm add it:

    x, h = ops.add_layer_norm(norm, x, delta, gate)   # x = x + gate * delta; h = norm(x)

``delta=None`` is a plain ``norm(x)`` (x returned as is); ``gate`` is None or a 1-element
tensor in x's dtype, already tanh'ed. :func:`add_pending` adds a pending delta with the torch
ops (where the full residual is needed without a norm: features saved, the last output).

Two op sets, chosen by device (:func:`add_norm_ops`): "torch" runs exactly the eager ops the
models ran before (``x + delta`` or ``x + gate * delta``, then the ``nn.LayerNorm`` module:
CPU results are bit-identical to them); "triton" runs
:func:`edserve.kernels.add_norm.add_layer_norm` (one read of x and delta, one write of the new
x and the normed rows; same rounding points), on CUDA when Triton imports and no gradient is
recorded (the kernel has no backward). A gate is applied by torch (``gate * delta``, one more
pass in Mllama's 8 gated layers): on the H200 the kernel's own gated path gave a residual
that differs from torch's in the first column of every row (its error against float64 is no
larger; the cause is not found), so the op set keeps torch's rounding there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# (delta, gate) a layer leaves to the next norm; NO_PENDING: nothing to add
Pending = tuple[torch.Tensor | None, torch.Tensor | None]
NO_PENDING: Pending = (None, None)


def add_pending(x: torch.Tensor, delta: torch.Tensor | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """``x + delta`` (``x + gate * delta`` with a gate; ``x`` when delta is None): torch ops."""
    if delta is None:
        return x
    return x + (delta if gate is None else gate * delta)


def add_layer_norm_torch(norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor | None = None,
                         gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager ops: ``x = add_pending(x, delta, gate)``, then ``(x, norm(x))``."""
    x = add_pending(x, delta, gate)
    return x, norm(x)


def add_layer_norm_triton(norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor | None = None,
                          gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Triton kernel (:mod:`edserve.kernels.add_norm`) with ``norm``'s weight, bias, eps."""
    from edserve.kernels.add_norm import add_layer_norm

    if tuple(norm.normalized_shape) != (x.shape[-1],):
        raise ValueError(f"norm over {tuple(norm.normalized_shape)}, rows of {x.shape[-1]}")
    if gate is not None:  # torch rounds gate * delta (the kernel's own gate: see module doc)
        delta = gate * delta
    return add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)


AddLayerNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AddNormOps:
    name: str
    add_layer_norm: AddLayerNorm  # (norm, x, delta=None, gate=None) -> (new x, norm(new x))


TORCH_ADD_NORM = AddNormOps("torch", add_layer_norm_torch)
TRITON_ADD_NORM = AddNormOps("triton", add_layer_norm_triton)


@functools.cache
def triton_available() -> bool:
    try:
        import edserve.kernels.add_norm  # noqa: F401
    except ImportError:
        return False
    return True


# device type -> the op set used there (when Triton imports); any other device: torch
ADD_NORM_BY_DEVICE: dict[str, AddNormOps] = {"cuda": TRITON_ADD_NORM}


def add_norm_ops(x: torch.Tensor) -> AddNormOps:
    """The op set for an encoder whose residual stream is ``x`` (module doc)."""
    ops = ADD_NORM_BY_DEVICE.get(x.device.type, TORCH_ADD_NORM)
    if ops is TORCH_ADD_NORM or torch.is_grad_enabled() or not triton_available():
        return TORCH_ADD_NORM
    return ops
