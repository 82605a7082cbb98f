"""The bidirectional self-attention of Whisper's audio encoder, chosen by ``--encoder-attention``.

A form is a function ``(q, k, v) -> o``: q, k, v ``[N, H, S, hd]`` (strided views of the
fused qkv projection), o ``[N, S, H, hd]`` (what ``out_proj`` reads after a reshape). The
registry :data:`ENCODER_ATTENTION`:

  sdpa  ``F.scaled_dot_product_attention`` (on an H100/H200 it picks cuDNN's fused kernel):
        any device, dtype and head dim; what torch.compile traces (``--compile-encoder``).
  tma   :func:`edserve.kernels.tma_attention.tma_attention`, a Triton flash attention whose
        tiles move by TMA descriptors: CUDA with compute capability 9.0+, bfloat16/float16,
        head dims of one or two power-of-two chunks (Whisper's 64). At large-v3's shape
        (20 x 64, 1500 tokens) it measured 2-7 % faster than cuDNN for 16 clips, between 5 %
        faster and 4 % slower for 64, and a prefill of 16 / 32 clips no faster than with SDPA
        (benchmarks/RESULTS.md, wave 38, H100 and H200).
  fa3   :func:`edserve.kernels.fa3_attention.fa3_attention`, FlashAttention-3's Hopper kernel
        through its C entry point: compute capability 9.0, bfloat16, head dims <= 96, and the
        library ``EDSERVE_FA3_LIB`` names (tools/build_fa3.sh builds it from FA3's source).

``auto`` (:func:`resolve_encoder_attention`) is ``fa3`` where it runs (its library loads, a
Hopper GPU, bfloat16, not compiled: 22 % faster than cuDNN at large-v3's shape for 16 clips, 7 %
for 64, H100, RESULTS.md wave 40), else ``sdpa`` (``tma``'s gain was inside the prefill's
run-to-run spread). A layer holds its form as ``layer.attend``;
:func:`set_encoder_attention` sets it on every encoder layer of a model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q/k/v ``[N, H, S, hd]`` -> ``[N, S, H, hd]`` (a transposed view of SDPA's output)."""
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def tma_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As :func:`sdpa_attend`, by the TMA kernel (a contiguous ``[N, S, H, hd]``; imported
    here: a CPU engine never imports Triton)."""
    from edserve.kernels.tma_attention import tma_attention

    return tma_attention(q, k, v)


def fa3_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As :func:`sdpa_attend`, by FlashAttention-3 (a contiguous ``[N, S, H, hd]``)."""
    from edserve.kernels.fa3_attention import fa3_attention

    return fa3_attention(q, k, v)


ENCODER_ATTENTION: dict[str, Attend] = {"sdpa": sdpa_attend, "tma": tma_attend,
                                        "fa3": fa3_attend}


def tma_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the ``tma`` form runs here, else why not (the kernel's own rules:
    :func:`~edserve.kernels.tma_attention.has_tma`, :func:`~edserve.kernels.tma_attention.
    tma_chunks`; imported past the CUDA check, so a CPU engine never imports Triton)."""
    if device.type != "cuda":
        return f"needs CUDA, the device is {device}"
    from edserve.kernels.tma_attention import has_tma, tma_chunks

    if not has_tma(device):
        return "needs compute capability 9.0+ (TMA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"needs bfloat16 or float16, the encoder runs {dtype}"
    if tma_chunks(head_dim) is None:
        return f"cannot read the encoder's head dim {head_dim} (tma_chunks)"
    return None


def fa3_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the ``fa3`` form runs here, else why not
    (:func:`~edserve.kernels.fa3_attention.fa3_unsupported`, imported past the CUDA check: a
    CPU engine never imports Triton)."""
    if device.type != "cuda":
        return f"needs CUDA, the device is {device}"
    from edserve.kernels.fa3_attention import fa3_unsupported

    return fa3_unsupported(device, dtype, head_dim)


# form -> (device, dtype, head dim) -> None where it runs, else why not
FORM_RULES: dict[str, Callable[[torch.device, torch.dtype, int], str | None]] = {
    "sdpa": lambda device, dtype, head_dim: None, "tma": tma_supported, "fa3": fa3_supported}


def resolve_encoder_attention(mode: str, device: torch.device, dtype: torch.dtype,
                              head_dim: int, compiled: bool) -> str:
    """``--encoder-attention`` resolved to a key of :data:`ENCODER_ATTENTION`: ``auto`` is
    ``fa3`` where it runs, else ``sdpa`` (see the module doc); ``tma`` or ``fa3`` where it
    cannot run (or with ``--compile-encoder``) raises ValueError saying why."""
    if mode not in ("auto", *ENCODER_ATTENTION):
        raise ValueError(f"--encoder-attention must be auto or one of "
                         f"{sorted(ENCODER_ATTENTION)}, got {mode!r}")
    if mode == "auto":
        fa3_runs = not compiled and fa3_supported(device, dtype, head_dim) is None
        return "fa3" if fa3_runs else "sdpa"
    why = FORM_RULES[mode](device, dtype, head_dim)
    if compiled and mode != "sdpa":
        why = "is not traced by --compile-encoder (use sdpa)"
    if why:
        raise ValueError(f"--encoder-attention {mode} {why}")
    return mode


def set_encoder_attention(model: nn.Module, mode: str) -> int:
    """Give every module of ``model`` with an ``attend`` attribute (Whisper's encoder layers)
    the form ``mode``; returns how many were set."""
    attend = ENCODER_ATTENTION[mode]
    n = 0
    for m in model.modules():
        if hasattr(m, "attend"):
            m.attend = attend
            n += 1
    return n
