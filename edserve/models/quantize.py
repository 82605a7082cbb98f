"""Post-load model transform: int8 dynamic quantization of linear layers on CPU.

Applied once, after the weights are loaded (like gpt-fast's ``quantize.py``); the model files
know nothing about it. ``--quantization int8`` replaces every ``nn.Linear`` (including the fused
q/k/v :class:`~edserve.models.weights.fused.FusedLinear`) by PyTorch's dynamic quantized linear
(``torch.ao.nn.quantized.dynamic.Linear``: int8 weights, one symmetric scale per output row;
activations quantized per call to uint8; fbgemm/x86 kernels, ``reduce_range`` for CPUs without
VNNI). Whisper's tied output projection (the token embedding read by ``compute_logits``, 20 of
tiny.en's 38 M parameters, read once per decode step) is quantized the same way; the embedding
lookup itself keeps the float table.

Whisper's stacked cross K/V projection (``decoder.cross_kv_proj``, ``[L * 2d, d]``, whose rows
the float path slices directly) becomes one int8 linear per decoder layer
(``decoder.cross_kv_layers``; the float module is dropped): at prefill, tiny.en's
``[1500, 384] x [3072, 384]`` took 27 ms in float32 and 8 ms as four int8 GEMMs on the 2-core
AVX-512 dev box (~3 % of an int8 beam-5 clip).
Left in float: convolutions, layer norms and attention.

Measured on the 2-core AVX2 development machine (``benchmarks/cpu_whisper.py``): fbgemm's
dynamic int8 GEMM is ~1.9x fp32 (MKL) at the encoder's shapes and ~25x at the logits GEMV
(the int8 table fits in cache), while torchao's / ``torch._int_mm`` int8 paths are 20-50x
slower than fp32 in eager mode there, and bfloat16 matmuls are ~5x slower than fp32 on a CPU
without native bf16.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

from edserve.models import int8_native
from edserve.models.opaque_linear import OpaqueLinear, replace_linears

QUANTIZATIONS = ("none", "int8")


def check_supported(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` naming the problem when ``mode`` cannot run on ``device``/``dtype``."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on CPU only (PyTorch's dynamic int8 "
                         f"linear has fbgemm/x86 CPU kernels); got --device {device}. Use "
                         f"--quantization none (bfloat16 is the fast mode on CUDA)")
    if dtype != torch.float32:
        raise ValueError(f"--quantization {mode} computes int8 x int8 with float32 "
                         f"activations; use --dtype float32 (or auto), got {dtype}")
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm")):
        raise ValueError(f"--quantization {mode}: this PyTorch build has no x86/fbgemm "
                         f"quantized engine (has {engines})")


def _quantized_engine() -> None:
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        engines = torch.backends.quantized.supported_engines
        torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


with warnings.catch_warnings():  # torch.ao / quantized-tensor deprecation notices
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as _DynamicLinear


_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default


def _linear_dynamic_call():
    """The cheapest way to call fbgemm's dynamic linear from Python, ``f(x, packed, True)``.

    Every Python route into an op with a ``ScriptObject`` argument (the packet, the overload,
    even its C++ callable ``_op``) first asks each argument for ``__torch_function__``; for a
    ScriptObject that lookup fails by throwing a C++ exception: ~11 us a call, against ~4 us for
    the GEMM of a one-row 384 x 384 linear (2-core Xeon, wave 30). The dispatcher's boxed call
    skips that check (same kernel, same result); ``_op`` where a build lacks it."""
    boxed = getattr(torch._C, "_dispatch_call_boxed", None)
    if boxed is None:
        return getattr(_LINEAR_DYNAMIC, "_op", _LINEAR_DYNAMIC)
    handle = torch._C._dispatch_find_schema_or_throw("quantized::linear_dynamic", "")
    return functools.partial(boxed, handle)  # no Python frame of its own


_LINEAR_DYNAMIC_CALL = _linear_dynamic_call()


class Int8Linear(OpaqueLinear, _DynamicLinear):
    """fbgemm's dynamic int8 linear; under ``torch.compile`` one call of the native op
    ``edserve_int8::linear`` once :meth:`attach_native` gave it a handle
    (:mod:`edserve.models.int8_native`), else of the opaque op
    (:mod:`edserve.models.opaque_linear`): dynamo cannot trace fbgemm's packed weights.

    ``eager`` is ``_DynamicLinear.forward`` for qint8 weights (``reduce_range`` as its version
    4 does) without its per-call Python: the packed weight is looked up once, at
    :meth:`register` (so call ``set_weight_bias`` before it: :func:`int8_linear` does)."""

    _prepacked = None  # the packed weight (a ScriptObject), cached by register()
    native: int | None = None  # its handle in the native op's table (:mod:`.int8_native`)

    def register(self) -> None:
        self._prepacked = self._packed_params._packed_params
        self.__dict__.pop("native", None)  # a deep copy's handle is the original's
        super().register()
        if int8_native.loaded():
            self.attach_native()

    def attach_native(self) -> None:
        """Keep the packed weight in the native op's table (the library loaded), so compiled
        graphs call ``edserve_int8::linear`` instead of the opaque op."""
        if self.native is None:
            self.native = int8_native.keep(self._prepacked)
            int8_native.release_with(self, self.native)

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return int8_native.linear(x, self.native, self.out_features)
        return super().compiled(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR_DYNAMIC_CALL(x, self._prepacked, True)  # float32 in and out

    def direct(self):
        packed = self._prepacked  # not the module: the function must not keep it alive
        return lambda x: _LINEAR_DYNAMIC_CALL(x, packed, True)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A dynamic int8 linear computing ``x @ weight.T + bias`` (``weight`` ``[out, in]``),
    weights quantized per output row (symmetric, zero point 0)."""
    with warnings.catch_warnings():  # torch.ao / quantized-tensor deprecation notices
        warnings.simplefilter("ignore")
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        # Built 1x1, then sized: the constructor would prepack a zero weight of full size.
        q = Int8Linear(1, 1, bias_=bias is not None, dtype=torch.qint8)
        q.in_features, q.out_features = w.shape[1], w.shape[0]
        q.set_weight_bias(qweight, None if bias is None else bias.detach().float())
    q.register()
    return q


class _TiedInt8Head(nn.Module):
    """``compute_logits`` through an int8 copy of the tied token embedding."""

    def __init__(self, embedding: torch.Tensor) -> None:
        super().__init__()
        self.proj = int8_linear(embedding, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


def supports(model: Any) -> bool:
    """Whether :func:`quantize_model` can quantize ``model`` (Whisper models)."""
    from edserve.models.whisper import WhisperForConditionalGeneration

    return isinstance(model, WhisperForConditionalGeneration)


def quantize_model(model: nn.Module, mode: str, encoder: bool = True) -> nn.Module:
    """Apply ``--quantization mode`` to a loaded model in place and return it.

    ``"none"`` returns the model unchanged. ``"int8"``: see the module doc; callers check
    :func:`check_supported` first. Only Whisper models are supported (``ValueError`` else).
    ``encoder`` False leaves the encoder's linears in float (``--encoder-dtype bfloat16``).
    """
    if mode == "none":
        return model
    if not supports(model):
        raise ValueError(f"--quantization {mode} supports Whisper models only, got "
                         f"{type(model).__name__}")
    _quantized_engine()
    replaced = _replace_linears(model, () if encoder else (model.model.encoder,))
    decoder = model.model.decoder
    w, b = decoder.cross_kv_proj.weight, decoder.cross_kv_proj.bias  # [L * 2d, d], [L * 2d]
    rows = 2 * decoder.embed_tokens.embedding_dim
    decoder.cross_kv_layers = nn.ModuleList(
        int8_linear(w[i * rows:(i + 1) * rows], None if b is None else b[i * rows:(i + 1) * rows])
        for i in range(len(decoder.layers)))
    decoder.cross_kv_proj = None  # its float weight is read no more (large-v3: 420 MB)
    replaced += len(decoder.layers)
    head = _TiedInt8Head(decoder.embed_tokens.weight)
    model.int8_logits_head = head  # registered submodule (repr, .to(), memory accounting)
    # Instance attribute shadows the class method: compute_logits(hidden) -> int8 GEMM.
    object.__setattr__(model, "compute_logits", head.forward)
    model.quantization = {"mode": mode, "linears": replaced}
    return model


def _replace_linears(root: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    return replace_linears(root, lambda lin: int8_linear(lin.weight, lin.bias), skip)


def describe(model: Any) -> str:
    """``"int8 (N linears + logits)"`` or ``"none"``, for logs and benchmarks."""
    q = getattr(model, "quantization", None)
    return f"{q['mode']} ({q['linears']} linears + logits)" if q else "none"
