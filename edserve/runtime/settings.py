"""Resolve every ``auto`` of an :class:`~edserve.config.EngineConfig` that depends on the
machine: device, dtype, CPU threads, attention kernels, page size. Done once, here; the rest of
the code reads only the resolved values (``RuntimeSettings``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from edserve.config import EngineConfig
from edserve.engine.cpu_modes import apply_threads, auto_cpu_dtype, cpu_features
from edserve.layers.attention import resolve_page_size
from edserve.models.cpu_linear import use_onednn
from edserve.models.fp8 import check_fp8, kv_cache_dtype
from edserve.models.quantize import check_supported

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeSettings:
    """What ``auto`` became on this machine."""

    device: torch.device
    dtype: torch.dtype
    threads: int | None  # torch CPU threads set at start (None on CUDA)
    ops: str  # attention kernels: "torch" or "triton"
    page_size: int
    kv_dtype: torch.dtype  # KV-cache storage (fp8 e4m3 with --kv-cache-dtype fp8)
    onednn_linears: bool = False  # --cpu-linear resolved: pack float32 linears for oneDNN
    encoder_dtype: str = "auto"  # --encoder-dtype resolved: auto (compute dtype), fp8, bfloat16

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return dev


def resolve_dtype(name: str, device: torch.device, quantization: str = "none",
                  features: frozenset[str] | None = None) -> torch.dtype:
    """``auto``: bfloat16 on CUDA; on CPU bfloat16 where bf16 matmuls are native, else float32
    (:func:`~edserve.engine.cpu_modes.auto_cpu_dtype`; ``features`` default: this CPU's).
    ``$EDSERVE_CPU_AUTO_DTYPE`` (e.g. ``float32``) replaces that choice for this CPU (the
    tests set it: their oracles run in float32 whatever the machine's bf16 support)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        forced = os.environ.get("EDSERVE_CPU_AUTO_DTYPE") if features is None else None
        if forced:
            return resolve_dtype(forced, device, quantization)
        return auto_cpu_dtype(cpu_features() if features is None else features, quantization)
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)} or auto, got {name!r}")
    return _DTYPES[name]


def resolve_settings(config: EngineConfig) -> RuntimeSettings:
    """Resolve and apply (CPU threads) the machine-dependent settings; raises ValueError for
    settings this machine cannot run, before anything is loaded."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.quantization)
    check_supported(config.quantization, device, dtype)
    onednn = use_onednn(config.cpu_linear, device, dtype, config.quantization)  # or raises
    threads = apply_threads(config.threads, device)
    ops = config.attention_backend
    if ops == "auto":
        ops = "triton" if device.type == "cuda" else "torch"
    restrict = tuple(int(s) for s in config.restrict_page_sizes.split(",")) \
        if config.restrict_page_sizes else None
    page_size = resolve_page_size(config.page_size, config.encoder_kv, ops, restrict)
    check_fp8(config.encoder_dtype, config.kv_cache_dtype, config.quantization, device, ops,
              dtype)
    return RuntimeSettings(device, dtype, threads, ops, page_size,
                           kv_cache_dtype(config.kv_cache_dtype, dtype), onednn,
                           resolve_encoder_dtype(config.encoder_dtype, config.quantization,
                                                 device, dtype))


def resolve_encoder_dtype(mode: str, quantization: str, device: torch.device,
                          compute: torch.dtype, features: frozenset[str] | None = None) -> str:
    """``--encoder-dtype`` as it runs here (:mod:`edserve.models.encoder_bf16`): ``auto``
    under ``--quantization int8`` on a CPU is ``bfloat16`` where ``--dtype auto`` without
    quantization would be (AMX tiles, or ``$EDSERVE_CPU_AUTO_DTYPE``: :func:`resolve_dtype`),
    else stays ``auto`` (the compute dtype); ``same`` (the encoder like the rest of the model,
    quantized with it) and ``bfloat16`` with a bfloat16 compute dtype are ``auto``.
    ``features``: this CPU's unless given."""
    if mode == "same" or (mode == "bfloat16" and compute == torch.bfloat16):
        return "auto"
    if mode != "auto" or device.type != "cpu" or quantization != "int8":
        return mode
    bf16_here = resolve_dtype("auto", device, "none", features) == torch.bfloat16
    return "bfloat16" if bf16_here else "auto"


def use_cuda_graph(config: EngineConfig, settings: RuntimeSettings) -> bool:
    """``--cuda-graph`` unset: on where supported (CUDA, triton, aligned/flat; not under
    tensor parallelism, whose followers mirror eager calls only)."""
    if config.tensor_parallel_size > 1:
        return False
    if config.cuda_graph is None:
        return settings.on_cuda and settings.ops == "triton" and config.encoder_kv != "ragged"
    return config.cuda_graph


# --cpu-compile auto: eager decode steps of a batch shape before it is compiled. Measured on the
# 2-core AMD EPYC (benchmarks/RESULTS.md 'CPU compiled decode'): a compile costs ~10 s with a
# warm inductor cache and 1-3 min cold, a compiled step saves ~15-40 ms under that load; so
# only shapes that run thousands of steps (long audio, a server) are compiled.
CPU_COMPILE_AFTER = 2048


def cpu_compile_after(config: EngineConfig, settings: RuntimeSettings,
                      model_type: str | None) -> int | None:
    """Eager decode steps a batch shape runs before it is compiled (``--cpu-compile``), or None
    (not compiled: off, not CPU, not Whisper, ragged KV, fp8 KV, tensor parallel). ``on`` where
    it cannot run raises ValueError."""
    if config.cpu_compile == "off":
        return None
    why = ("it runs on CPU only" if settings.on_cuda else
           "it compiles Whisper decoders only" if model_type != "whisper" else
           "it needs --encoder-kv flat or aligned" if config.encoder_kv == "ragged" else
           "it needs a KV cache in the compute dtype" if settings.kv_dtype != settings.dtype
           else "it runs on one rank" if config.tensor_parallel_size > 1 else None)
    if why is not None:
        if config.cpu_compile == "on":
            raise ValueError(f"--cpu-compile on: {why}")
        return None
    return 0 if config.cpu_compile == "on" else CPU_COMPILE_AFTER


def use_device_beams(config: EngineConfig, settings: RuntimeSettings) -> bool:
    """``--beam-on-device`` unset: on where steps overlap (CUDA, overlap not off; one rank),
    where choosing beams without a sync pays; the host path on CPU."""
    if config.beam_on_device is not None:
        return config.beam_on_device
    return settings.on_cuda and config.overlap_schedule != "off" \
        and config.tensor_parallel_size == 1
