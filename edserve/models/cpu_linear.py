"""Post-load model transform: float32 CPU linears through oneDNN with prepacked weights.

PyTorch's CPU ``F.linear`` calls MKL's sgemm. MKL picks its fast code paths by CPU vendor; on
the AMD EPYC development machine (AVX2) the decoder's small-batch GEMMs ran at a fraction of
memory speed there, while oneDNN with the weight reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what inductor's CPU
freezing pass emits) was measured, 2 threads, fp32 (``benchmarks/cpu_linear.py``):

* the tied logits projection ``[rows, 384] x [51864, 384]``: 6.4 vs 12.3 ms at 1 row, 8.6 vs
  26 ms at 5 rows (a beam group);
* the layers' qkv / fc1 / fc2 at 2-5 rows: 1.4-1.5x faster (384 x 384: 0.84-0.94x); at 1 row
  MKL is faster (0.06 vs 0.10 ms for 384 x 384), so single-row calls keep MKL
  (:attr:`PackedLinear.min_rows`);
* the encoder's 1500-row linears: 0.97-1.16x. Under ``--compile-encoder`` the encoder is
  left as it is (its one compiled layer graph would recompile for each layer's opaque linear);
  ``--encoder-dtype fp8`` replaces the encoder's linears first (fp8 ones are not packed).

``--cpu-linear auto`` packs on CPUs whose vendor is not Intel (MKL's own vendor is served
well by MKL; not measured here), ``onednn`` always, ``mkl`` never. Results differ from
MKL's in the last bits (summation order, ~1e-4 absolute on tiny.en logits); the bundled
clips' text is the same either way (tests/models/test_cpu_linear.py).

The layers keep their float weight (``.weight``, for single-row calls and inspection); the
packed copy is extra memory (tiny.en: +37 M floats). Only float32 CPU models are packed
(bfloat16 CPUs already run oneDNN; ``--quantization int8`` has its own kernels).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from edserve.config import CPU_LINEAR_MODES
from edserve.models.opaque_linear import OpaqueLinear, replace_linears


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``; ``""`` unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def use_onednn(mode: str, device: torch.device, dtype: torch.dtype, quantization: str,
               vendor: str | None = None) -> bool:
    """Whether ``--cpu-linear mode`` packs this model's linears (see the module doc).
    ``onednn`` on an engine it cannot apply to (not float32 on CPU without quantization) is a
    ValueError; ``auto`` then leaves the model as it is."""
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"--cpu-linear must be one of {CPU_LINEAR_MODES}, got {mode!r}")
    if mode == "mkl":
        return False
    fits = device.type == "cpu" and dtype == torch.float32 and quantization == "none"
    if mode == "onednn" and not fits:
        raise ValueError(f"--cpu-linear onednn applies to float32 linears on CPU without "
                         f"--quantization; this engine runs {str(dtype).split('.')[-1]} on "
                         f"{device} with --quantization {quantization}")
    if not fits:
        return False
    if not torch.backends.mkldnn.is_available():
        if mode == "onednn":
            raise ValueError("--cpu-linear onednn: this PyTorch build has no oneDNN (mkldnn)")
        return False
    return mode == "onednn" or (vendor if vendor is not None else cpu_vendor()) != "GenuineIntel"


def apply_cpu_linear(model: nn.Module, mode: str, onednn: bool,
                     compile_encoder: bool = False) -> nn.Module:
    """``--cpu-linear mode`` applied to a loaded model (in place; returned), ``onednn`` being
    :func:`use_onednn`'s decision (made once, with the runtime settings). ``auto`` leaves
    models other than Whisper as they are; ``onednn`` on one of them is a ValueError.
    ``compile_encoder``: leave the encoder's linears to ``--compile-encoder``."""
    from edserve.models.whisper import WhisperForConditionalGeneration

    if not onednn:
        return model
    if mode == "auto" and not isinstance(model, WhisperForConditionalGeneration):
        return model
    return pack_linears(model, encoder=not compile_encoder)


class PackedLinear(OpaqueLinear, nn.Module):
    """``x @ weight.T + bias`` through oneDNN's prepacked weight; calls of fewer than
    ``min_rows`` rows use ``F.linear`` on the float weight (MKL is faster there)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)  # oneDNN layout
        self.min_rows = min_rows
        self.register()

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedLinear:  # oneDNN tensors have no storage to copy
        bias = None if self.bias is None else copy.deepcopy(self.bias.data, memo)
        clone = PackedLinear(copy.deepcopy(self.weight.data, memo), bias, self.min_rows)
        memo[id(self)] = clone
        if hasattr(self, "parts"):
            clone.parts = self.parts
        return clone

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, oneDNN from {self.min_rows} rows"


def pack_linears(model: nn.Module, min_rows: int = 2, encoder: bool = True) -> nn.Module:
    """Replace a Whisper model's float linears (the encoder's only with ``encoder``) and its
    tied logits projection by :class:`PackedLinear` in place (the logits always packed: 2x
    faster even at one row)."""
    from edserve.models.whisper import WhisperForConditionalGeneration

    if not isinstance(model, WhisperForConditionalGeneration):
        raise ValueError(f"--cpu-linear onednn supports Whisper models only, got "
                         f"{type(model).__name__}")
    count = _replace(model.model.decoder, min_rows)
    if encoder:
        count += _replace(model.model.encoder, min_rows)
    head = PackedLinear(model.model.decoder.embed_tokens.weight, None, min_rows=1)
    model.packed_logits_head = head  # registered submodule (repr, memory accounting)
    object.__setattr__(model, "compute_logits", head.forward)  # shadows the class method
    model.cpu_linear = {"backend": "onednn", "linears": count}
    return model


def _replace(root: nn.Module, min_rows: int) -> int:
    return replace_linears(root, lambda lin: PackedLinear(lin.weight, lin.bias, min_rows))
