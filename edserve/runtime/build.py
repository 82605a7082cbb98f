"""``build_engine``: config -> settings -> checkpoint -> model -> pools -> graphs -> Engine.

The order is nano-vllm's model runner's: load, then size the KV cache from what is left, then
capture graphs over the pools. Every caller that needs an engine (CLI, batch CLI, server,
data-parallel worker, Ray Serve, the top-level API, benchmarks, tests) comes through here.
"""

from __future__ import annotations

import logging
from typing import Any

from edserve.config import EngineConfig
from edserve.engine.beam_choices import check_choice
from edserve.engine.cpu_compile import CompiledDecodeRunner
from edserve.engine.cuda_graph import DecodeGraphRunner
from edserve.engine.engine import Engine
from edserve.engine.parts import EngineParts
from edserve.layers.attention import create_backend
from edserve.layers.encoder_attention import resolve_encoder_attention, set_encoder_attention
from edserve.layers.linear_gelu import resolve_linear_gelu, set_linear_gelu
from edserve.models.catalog import model_cache_dir
from edserve.models.cpu_linear import apply_cpu_linear
from edserve.models.fp8 import apply_encoder_dtype
from edserve.models.quantize import quantize_model
from edserve.models.registry import build_model
from edserve.models.weights import load_checkpoint
from edserve.runtime.pools import build_pools
from edserve.runtime.settings import (
    RuntimeSettings,
    cpu_compile_after,
    resolve_settings,
    use_cuda_graph,
    use_device_beams,
)

logger = logging.getLogger("edserve")

DEFAULT_MAX_CONTEXT = 8192  # decoder positions when --context-length is not given
DEFAULT_PREFILL_TOKENS = {False: 65536, True: 262144}  # by "on CUDA"
# --max-mixed-prefill-tokens unset, for Whisper on CUDA: this many windows (the encoder graphs'
# batches) with prompts up to MIXED_PROMPT_TOKENS each; elsewhere --max-prefill-tokens
MIXED_WINDOWS_AUTO = 4
MIXED_PROMPT_TOKENS = 128
# --encoder-cuda-graph-max-bs unset, on CUDA: batches up to 4 clips are launch-bound (large-v3,
# H200: batch 1 9.3 -> 5.7 ms per clip, batch 16 unchanged; benchmarks/RESULTS.md)
ENCODER_GRAPH_MAX_BS_AUTO = 4
# --encoder-warmup-max-bs unset, on CUDA: arrivals prefill in batches of 1..16 at 32 clients;
# each new batch size cost ~4 ms of host time in cuDNN/cuBLAS (large-v3, H200, gpu_idle.py)
ENCODER_WARMUP_MAX_BS_AUTO = 16


def build_engine(config: EngineConfig | None = None, *, checkpoint: Any = None,
                 **overrides: Any) -> Engine:
    """``build_engine(EngineConfig(...))`` or ``build_engine(page_size="16", ...)``.

    ``checkpoint``: an already loaded :class:`~edserve.models.weights.Checkpoint` (benchmarks
    build random-weight models in memory); default: load ``config.model``. Raises ValueError
    for settings this machine or model cannot run, before loading where possible.
    """
    config = (config or EngineConfig()).replace(**overrides)
    s = resolve_settings(config)
    if config.beam_choice != "auto":  # e.g. triton on a CPU: said now, not at the first beam
        check_choice(config.beam_choice, s.device)
    if config.tensor_parallel_size > 1:  # rank 0 of a tensor-parallel group
        # imported here: it brings the Mllama model (~0.2 s of a Whisper CLI's start-up)
        from edserve.parallel import build_sharded_model

        model, tokenizer = build_sharded_model(config, checkpoint, s.dtype, s.device)
    else:
        if checkpoint is None:
            checkpoint = load_checkpoint(config.model)
        model, tokenizer = build_model(checkpoint, s.dtype, s.device)
        del checkpoint
        model = quantize_model(model, config.quantization,
                               encoder=s.encoder_dtype != "bfloat16")
        model = apply_encoder_dtype(model, s.encoder_dtype)
        model_type = getattr(model, "model_type", None)
        set_linear_gelu(model, resolve_linear_gelu(config.encoder_gelu, s.device, s.dtype,
                                                   model_type))
        set_linear_gelu(model, resolve_linear_gelu(config.decoder_gelu, s.device, s.dtype,
                                                   model_type, "--decoder-gelu"),
                        "mlp_gelu", "--decoder-gelu")
        _encoder_attention(model, config, s)
        model = apply_cpu_linear(model, config.cpu_linear, s.onednn_linears,
                                 config.compile_encoder)
        _encoder_options(model, config, s)
    warm = config.encoder_warmup_max_bs  # run by the stepping thread (Engine.warm_up)
    if warm is None:
        warm = ENCODER_WARMUP_MAX_BS_AUTO if s.on_cuda and config.tensor_parallel_size == 1 \
            else 0
    max_decoder_len = min(model.max_decoder_len, config.context_length or DEFAULT_MAX_CONTEXT)
    backend = create_backend(config.encoder_kv, s.page_size, s.ops,
                             grouped_cross=config.grouped_cross_attention)
    max_row = backend.encoder_region(model.max_encoder_len) + max_decoder_len
    sizing = build_pools(config, s, model, backend, max_row)
    running = sizing.max_running_requests
    prefill, mixed = prefill_budgets(config, s, model, backend, max_row)
    graphs = None
    if use_cuda_graph(config, s):
        graphs = DecodeGraphRunner(model, sizing.pools,
                                   min(config.cuda_graph_max_bs or running, running),
                                   config.prompt_cuda_graph_max_tokens,
                                   sampling=config.sampling_cuda_graph)
    elif (after := cpu_compile_after(config, s, getattr(model, "model_type", None))) is not None:
        graphs = CompiledDecodeRunner(model, sizing.pools, running, model.max_encoder_len,
                                      max_decoder_len, after, model_cache_dir(),
                                      sampling=config.cpu_compile_sampling)
    return Engine(EngineParts(
        config=config.replace(max_running_requests=running, encoder_warmup_max_bs=warm,
                              beam_on_device=use_device_beams(config, s)),
        device=s.device, dtype=s.dtype,
        threads=s.threads, page_size=s.page_size, model=model, tokenizer=tokenizer,
        pools=sizing.pools, max_decoder_len=max_decoder_len,
        max_prefill_tokens=prefill, max_mixed_prefill_tokens=mixed, graphs=graphs))


def prefill_budgets(config: EngineConfig, s: RuntimeSettings, model: Any, backend: Any,
                    max_row: int) -> tuple[int, int]:
    """``(--max-prefill-tokens, --max-mixed-prefill-tokens)`` resolved; each admits at least
    one request of the longest kind (``max_row`` tokens)."""
    prefill = max(config.max_prefill_tokens or DEFAULT_PREFILL_TOKENS[s.on_cuda], max_row)
    mixed = config.max_mixed_prefill_tokens
    if mixed is None and s.on_cuda and getattr(model, "model_type", None) == "whisper":
        mixed = MIXED_WINDOWS_AUTO * (backend.encoder_region(model.max_encoder_len)
                                      + MIXED_PROMPT_TOKENS)
    return prefill, min(prefill, max(mixed or prefill, max_row))


def encoder_graph_max_bs(config: EngineConfig, s: RuntimeSettings, whisper: bool) -> int:
    """``--encoder-cuda-graph-max-bs`` resolved: as given, or (unset)
    :data:`ENCODER_GRAPH_MAX_BS_AUTO` for a Whisper encoder where decode steps use CUDA graphs,
    not with --compile-encoder, else 0. With --encoder-dtype fp8 the graphs matter most: a
    one-clip fp8 prefill step took 37.7 ms of host launches on the H200 without them, 7.6 ms
    with them (benchmarks/RESULTS.md, wave 12)."""
    if config.encoder_cuda_graph_max_bs is not None:
        return config.encoder_cuda_graph_max_bs
    auto = whisper and not config.compile_encoder and use_cuda_graph(config, s)
    return ENCODER_GRAPH_MAX_BS_AUTO if auto else 0


def _encoder_attention(model: Any, config: EngineConfig, s: RuntimeSettings) -> None:
    """``--encoder-attention`` on Whisper's encoder layers (other models: only ``auto``)."""
    encoder = getattr(getattr(model, "model", None), "encoder", None)
    layers = getattr(encoder, "layers", None)
    if not layers or not hasattr(layers[0], "attend"):
        if config.encoder_attention != "auto":
            raise ValueError(f"--encoder-attention {config.encoder_attention}: Whisper "
                             f"models only, got {type(model).__name__}")
        return
    cfg = model.config
    head_dim = cfg.d_model // cfg.encoder_attention_heads
    mode = resolve_encoder_attention(config.encoder_attention, s.device, s.dtype, head_dim,
                                     config.compile_encoder)
    set_encoder_attention(encoder, mode)


def _encoder_options(model: Any, config: EngineConfig, s: RuntimeSettings) -> None:
    """``--compile-encoder``, then ``--encoder-cuda-graph-max-bs`` (which captures the
    compiled encoder; unset: :data:`ENCODER_GRAPH_MAX_BS_AUTO` where decode steps use CUDA
    graphs). Whisper only."""
    graph_bs = encoder_graph_max_bs(config, s, hasattr(model, "capture_encoder_graphs"))
    wanted = [flag for flag, on in (("--compile-encoder", config.compile_encoder),
                                    ("--encoder-cuda-graph-max-bs", graph_bs)) if on]
    if not wanted:
        return
    if not hasattr(model, "capture_encoder_graphs"):
        raise ValueError(f"{' and '.join(wanted)}: Whisper models only, got "
                         f"{type(model).__name__}")
    if config.compile_encoder:
        model.compile_encoder()
    if graph_bs:
        model.capture_encoder_graphs(graph_bs)
