"""The checks of an :class:`~edserve.config.EngineConfig`'s values and combinations: a bad
value or a combination that cannot run is a ValueError naming the flag, at construction."""

from __future__ import annotations

from typing import Any

ENCODER_KV_STRATEGIES = ("aligned", "ragged", "flat")
QUANTIZATION_MODES = ("none", "int8")
CPU_LINEAR_MODES = ("auto", "mkl", "onednn")  # --cpu-linear (edserve.models.cpu_linear)
# --encoder-dtype (edserve.models.fp8, edserve.models.encoder_bf16); same: as the rest of the model
ENCODER_DTYPES = ("auto", "same", "fp8", "bfloat16")


def check_engine_config(c: Any) -> None:
    """Raise ValueError for the first invalid value or combination of ``c`` (an
    :class:`~edserve.config.EngineConfig`; this module imports nothing of edserve, so the
    config can import it)."""
    if c.encoder_kv not in ENCODER_KV_STRATEGIES:
        raise ValueError(f"--encoder-kv must be one of {ENCODER_KV_STRATEGIES}, "
                         f"got {c.encoder_kv!r}")
    if c.cuda_graph and c.encoder_kv == "ragged":
        raise ValueError("--cuda-graph cannot be used with --encoder-kv ragged: the ragged "
                         "strategy gathers data-dependent buffers every step; use flat or "
                         "aligned")
    if c.max_running_requests is not None and c.max_running_requests < 1:
        raise ValueError(f"--max-running-requests must be >= 1, "
                         f"got {c.max_running_requests}")
    if not 0.0 < c.mem_fraction_static <= 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], "
                         f"got {c.mem_fraction_static}")
    if c.quantization not in QUANTIZATION_MODES:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_MODES}, "
                         f"got {c.quantization!r}")
    if c.cpu_linear not in CPU_LINEAR_MODES:
        raise ValueError(f"--cpu-linear must be auto, mkl or onednn, got {c.cpu_linear!r}")
    if c.beam_choice not in ("auto", "triton", "ops"):
        raise ValueError(f"--beam-choice must be auto, triton or ops, got {c.beam_choice!r}")
    if c.cpu_compile not in ("auto", "on", "off"):
        raise ValueError(f"--cpu-compile must be auto, on or off, got {c.cpu_compile!r}")
    for name in ("max_prefill_tokens", "max_mixed_prefill_tokens"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
    if c.threads is not None and c.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {c.threads}")
    if c.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, "
                         f"got {c.tensor_parallel_size}")
    if c.tensor_parallel_size > 1 and c.cuda_graph:
        raise ValueError("--cuda-graph cannot be used with --tensor-parallel-size > 1 "
                         "(the other ranks mirror eager steps only)")
    if c.tensor_parallel_size > 1 and c.quantization != "none":
        raise ValueError("--quantization cannot be used with --tensor-parallel-size > 1")
    if c.tensor_parallel_size > 1 and (c.compile_encoder
                                          or c.encoder_cuda_graph_max_bs
                                          or c.encoder_gelu == "tanh"
                                          or c.decoder_gelu == "tanh"
                                          or c.encoder_attention == "tma"):
        raise ValueError("--compile-encoder, --encoder-cuda-graph-max-bs, --encoder-gelu "
                         "/ --decoder-gelu tanh and --encoder-attention tma cannot be used "
                         "with --tensor-parallel-size > 1")
    if c.encoder_warmup_max_bs is not None and c.encoder_warmup_max_bs < 0:
        raise ValueError(f"--encoder-warmup-max-bs must be >= 0, got "
                         f"{c.encoder_warmup_max_bs}")
    if c.encoder_cuda_graph_max_bs is not None and c.encoder_cuda_graph_max_bs < 0:
        raise ValueError(f"--encoder-cuda-graph-max-bs must be >= 0 (0: off), "
                         f"got {c.encoder_cuda_graph_max_bs}")
    if c.prompt_cuda_graph_max_tokens < 0:
        raise ValueError(f"--prompt-cuda-graph-max-tokens must be >= 0 (0: off), "
                         f"got {c.prompt_cuda_graph_max_tokens}")
    if c.admission_wait_ms < 0 or c.admission_batch < 1:
        raise ValueError("--admission-wait-ms must be >= 0 and --admission-batch >= 1, got "
                         f"{c.admission_wait_ms} / {c.admission_batch}")
    if c.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {c.max_new_tokens}")
