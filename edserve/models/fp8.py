"""fp8 (e4m3) options, off by default: the encoder's linear layers (``--encoder-dtype fp8``)
and the KV cache's storage (``--kv-cache-dtype fp8``).

Encoder: every linear layer of Whisper's encoder layers (fused q/k/v, out, fc1, fc2) becomes an
:class:`Fp8Linear`: weights quantized once per output row (symmetric, scale = row amax / 448),
activations per token at every call (scale = token amax / 448), both to ``float8_e4m3fn``; the
product is accumulated in fp32 and scaled back (row-wise scaling). On CUDA with fp8 tensor
cores (compute capability 8.9+: Ada, Hopper) that is one ``torch._scaled_mm``; elsewhere the
same numbers are emulated (quantize, dequantize, matmul in the model dtype), which is slower
than the plain model and exists to measure the accuracy cost (``benchmarks/fp8_accuracy.py``).
Convolutions, layer norms, attention and the decoder stay in the model dtype.

KV cache: the pool stores K and V as ``float8_e4m3fn`` with a static per-tensor scale of 1
(values cast with saturation at +-448; Whisper's K/V lie well inside), and every read
dequantizes to the compute dtype (a cast) before attention. It halves the bytes a decode step
reads from the cross K/V.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edserve.config import ENCODER_DTYPES
from edserve.models.encoder_bf16 import encoder_in_bf16

FP8_MODES = ("auto", "fp8")  # --kv-cache-dtype (--encoder-dtype: config.ENCODER_DTYPES)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ENCODER_LINEARS = ("qkv_proj", "out_proj", "fc1", "fc2")


def fp8_hardware(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (``torch._scaled_mm``)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8(encoder_dtype: str, kv_cache_dtype: str, quantization: str,
              device: torch.device, attention_ops: str, compute: torch.dtype) -> None:
    """Raise ``ValueError`` naming the problem when a chosen fp8 option cannot run."""
    if encoder_dtype not in ENCODER_DTYPES:
        raise ValueError(f"--encoder-dtype must be one of {ENCODER_DTYPES}, got "
                         f"{encoder_dtype!r}")
    if kv_cache_dtype not in FP8_MODES:
        raise ValueError(f"--kv-cache-dtype must be one of {FP8_MODES}, got {kv_cache_dtype!r}")
    wants = [f for f, v in (("--encoder-dtype", encoder_dtype),
                            ("--kv-cache-dtype", kv_cache_dtype)) if v == "fp8"]
    if not wants:
        return
    if encoder_dtype == "fp8" and quantization != "none":
        raise ValueError(f"--encoder-dtype fp8 and --quantization {quantization} both rewrite "
                         "the encoder's linear layers; choose one")
    if device.type == "cuda" and not fp8_hardware(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"{' and '.join(wants)} fp8 needs fp8 tensor cores (compute "
                         f"capability 8.9+: Ada, Hopper); {device} has {cap}")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{' and '.join(wants)} fp8: CUDA or CPU (emulated) only, got {device}")
    if encoder_dtype == "fp8" and device.type == "cuda" and compute != torch.bfloat16:
        raise ValueError(f"--encoder-dtype fp8 on CUDA computes with bfloat16 activations "
                         f"(row-wise scaled fp8 GEMMs); use --dtype bfloat16, got {compute}")
    if kv_cache_dtype == "fp8" and device.type == "cpu" and attention_ops != "torch":
        raise ValueError("--kv-cache-dtype fp8 on CPU needs --attention-backend torch")


def kv_cache_dtype(mode: str, compute: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype for ``--kv-cache-dtype``."""
    return FP8 if mode == "fp8" else compute


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (``float8_e4m3fn`` ``[M, K]``, fp32 scales ``[M, 1]``) with
    ``x ~= q * scale`` (symmetric, one scale per row; an all-zero row gets a tiny scale)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True)  # one pass
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)  # [M, 1] fp32
    return torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale  # x / scale in fp32


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with fp8 weights (per output row) and fp8 activations (per token).

    ``input_gelu`` (``None``, ``"exact"``, ``"tanh"``): apply that GELU to ``x`` first, inside
    the activation quantization (an encoder MLP's ``fc2``: the GELU of ``fc1``'s output costs no
    pass of its own; :func:`fp8_encoder_layers` sets it, ``set_linear_gelu`` changes it). On
    CUDA the GELU and the scaling are one Triton kernel (:mod:`edserve.kernels.fp8_quant`) and
    the bias is added in ``torch._scaled_mm``'s epilogue."""

    def __init__(self, linear: nn.Linear, input_gelu: str | None = None) -> None:
        super().__init__()
        w, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", w)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # [1, out] fp32
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.input_gelu = input_gelu
        self.parts = getattr(linear, "parts", None)  # FusedLinear's row layout stays inspectable
        # Decided once (forward stays free of device queries, so torch.compile traces it whole):
        # torch._scaled_mm on fp8 hardware, else the emulation with W as it is used.
        self.scaled_mm = fp8_hardware(w.device)
        if self.scaled_mm:  # Triton comes with CUDA builds of torch; CPU installs may lack it
            from edserve.kernels.fp8_quant import quantize_rows_fp8
            self._quantize = quantize_rows_fp8
        self._dequantized = None if self.scaled_mm else \
            (w.float() * scale).to(linear.weight.dtype)  # [out, in] in the model dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out] in x's dtype (the model dtype)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.scaled_mm:
            xq, xs = self._quantize(x2, self.input_gelu)  # [M, in] fp8, [M, 1] fp32
            y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale,
                                 bias=self.bias, out_dtype=x.dtype)
        else:  # emulation: the same rounding, the product in x's dtype
            if self.input_gelu is not None:
                x2 = F.gelu(x2, approximate="none" if self.input_gelu == "exact" else "tanh")
            xq, xs = quantize_rows(x2)
            y = F.linear((xq.float() * xs).to(x.dtype), self._dequantized.to(x.dtype))
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def apply_encoder_dtype(model: Any, mode: str) -> Any:
    """``--encoder-dtype fp8``: the encoder layers' linears become :class:`Fp8Linear` (in place;
    Whisper models only, ``ValueError`` else); ``bfloat16``: the encoder in bfloat16
    (:mod:`edserve.models.encoder_bf16`; ``mode`` as resolved there). ``auto`` leaves the model
    unchanged."""
    if mode == "auto":
        return model
    if mode == "bfloat16":
        return encoder_in_bf16(model)
    from edserve.models.whisper import WhisperForConditionalGeneration

    if not isinstance(model, WhisperForConditionalGeneration):
        raise ValueError(f"--encoder-dtype {mode} supports Whisper models only, got "
                         f"{type(model).__name__}")
    fp8_encoder_layers(model.model.encoder)
    return model


def fp8_encoder_layers(encoder: nn.Module) -> None:
    """Every linear layer of a Whisper encoder's layers becomes an :class:`Fp8Linear` (in
    place); each MLP's GELU moves from after ``fc1`` into ``fc2``'s input quantization (the
    layer's ``linear_gelu`` becomes :func:`~edserve.layers.linear_gelu.linear_only`)."""
    from edserve.layers.linear_gelu import gelu_mode_of, linear_only

    for layer in encoder.layers:
        for owner in (layer.self_attn, layer):
            for name in _ENCODER_LINEARS:
                child = getattr(owner, name, None)
                if isinstance(child, nn.Linear):
                    setattr(owner, name, Fp8Linear(child))
        if isinstance(layer.fc2, Fp8Linear) and layer.linear_gelu is not linear_only:
            layer.fc2.input_gelu = gelu_mode_of(layer.linear_gelu)
            layer.linear_gelu = linear_only
