"""``gelu(fc1(x))`` of the encoders' MLPs (Whisper's audio encoder, Mllama's vision tower) and
of Whisper's decoder MLPs (``--decoder-gelu``, the same forms and ``auto`` rule).

Two forms of GELU, chosen by ``--encoder-gelu`` (a registry, :data:`LINEAR_GELU`; ``auto``:
:func:`resolve_linear_gelu`):

  exact  ``F.gelu(fc1(x))``: the GEMM (bias in its epilogue), then the erf GELU as a second
         pass over the ``[tokens, ffn]`` activations. What the checkpoints were trained with
         and what HF runs. On the H200 that pass is 5.6 ms of a 75 ms large-v3 prefill step
         of 16 clips (benchmarks/RESULTS.md).
  tanh   GELU's tanh approximation. On CUDA, for a plain ``nn.Linear``, one GEMM with bias +
         GELU in cuBLASLt's epilogue (``torch._addmm_activation(..., use_gelu=True)``: its GELU
         is the tanh form): the activations are written once, never re-read. Elsewhere (CPU,
         quantized or fp8 linears) ``F.gelu(fc1(x), approximate="tanh")``: the same function,
         two passes. The two forms differ by at most :data:`MAX_TANH_GAP` (absolute), well
         under bfloat16's rounding step at the inputs where they differ most.

A layer holds its form as ``layer.linear_gelu`` (a function ``(fc1, x) -> gelu(fc1(x))``);
:func:`set_linear_gelu` sets it on every layer of a model that has one. A layer whose ``fc2``
takes the GELU into its own input (``--encoder-dtype fp8``: ``Fp8Linear.input_gelu``, fused
into the activation quantization) holds :func:`linear_only` instead, and the form is set on
its ``fc2``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearGelu = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (fc1, x [..., d]) -> [..., ffn]

# max |gelu_tanh(x) - gelu(x)| over all x: 4.73e-4, at |x| = 2.70 (where bfloat16 steps by 1.6e-2)
MAX_TANH_GAP = 5e-4


def linear_gelu_exact(fc: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(fc(x))``, the erf GELU (two passes)."""
    return F.gelu(fc(x))


def linear_gelu_tanh(fc: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(fc(x))``: cuBLASLt's bias + GELU epilogue for a plain CUDA ``nn.Linear``
    with a bias and rows contiguous in the last dim, else the torch ops (same function)."""
    if type(fc) is nn.Linear and fc.bias is not None and x.is_cuda \
            and x.stride(-1) == 1 and not torch.is_grad_enabled():
        x2 = x.reshape(-1, x.shape[-1])  # [T, d]
        y = torch._addmm_activation(fc.bias, x2, fc.weight.t(), use_gelu=True)  # [T, ffn]
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.gelu(fc(x), approximate="tanh")


LINEAR_GELU: dict[str, LinearGelu] = {"exact": linear_gelu_exact, "tanh": linear_gelu_tanh}


def linear_only(fc: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``fc(x)``: the GELU is applied by the next linear's input (see the module doc)."""
    return fc(x)


def gelu_mode_of(form: LinearGelu) -> str:
    """The :data:`LINEAR_GELU` key of ``form`` (``ValueError`` for another function)."""
    for mode, f in LINEAR_GELU.items():
        if f is form:
            return mode
    raise ValueError(f"{form!r} is not a GELU form of {sorted(LINEAR_GELU)}")


# models whose encoder MLPs take tanh under ``auto``: where it was measured faster (the Mllama
# vision tower measured no change on the H200: 17.41 vs 17.86 ms per tile, RESULTS.md wave 9)
AUTO_TANH_MODELS = ("whisper",)


def resolve_linear_gelu(mode: str, device: torch.device, dtype: torch.dtype,
                        model_type: str | None, flag: str = "--encoder-gelu") -> str:
    """``--encoder-gelu auto``: ``tanh`` for a model of :data:`AUTO_TANH_MODELS` on CUDA in
    bfloat16/float16 (the epilogue fuses there, and the forms' gap is a few percent of one
    rounding step of those dtypes: on the H200 the large-v3 encoder's output moved by as much
    as between two exact implementations), else ``exact`` (CPU, float32, other models). An
    explicit mode is returned as is."""
    if mode != "auto":
        if mode not in LINEAR_GELU:
            raise ValueError(f"{flag} must be auto or one of {sorted(LINEAR_GELU)}, "
                             f"got {mode!r}")
        return mode
    half = dtype in (torch.bfloat16, torch.float16)
    fused = device.type == "cuda" and half and model_type in AUTO_TANH_MODELS
    return "tanh" if fused else "exact"


def set_linear_gelu(model: nn.Module, mode: str, attr: str = "linear_gelu",
                    flag: str = "--encoder-gelu") -> int:
    """Give every module of ``model`` that has an ``attr`` attribute (``linear_gelu``: the
    encoder MLPs; ``mlp_gelu``: Whisper's decoder MLPs, ``--decoder-gelu``) the form ``mode``
    (a key of :data:`LINEAR_GELU`); returns how many were set (ValueError for an unknown
    mode, or for ``tanh`` on a model without such layers: the option would do nothing)."""
    if mode not in LINEAR_GELU:
        raise ValueError(f"{flag} must be one of {sorted(LINEAR_GELU)}, got {mode!r}")
    n = 0
    for m in model.modules():
        if hasattr(m, attr):
            if hasattr(getattr(m, "fc2", None), "input_gelu"):  # fc2 applies it (fp8)
                m.fc2.input_gelu = mode
                setattr(m, attr, linear_only)
            else:
                setattr(m, attr, LINEAR_GELU[mode])
            n += 1
    if n == 0 and mode != "exact":
        raise ValueError(f"{flag} {mode}: {type(model).__name__} has no MLP that takes it")
    return n
