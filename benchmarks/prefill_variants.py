"""The prefill paths ``prefill_gpu.py`` compares, as switchable states of one engine (issue 19).

  before        the encoder as it was (positions added to the conv output's transposed view:
                a strided residual stream, every layer norm copying it) + ``index_put`` cross
                K/V writes: the path measured in benchmarks/RESULTS.md on 2026-12-01
  contiguous    the contiguous residual stream, ``index_put`` writes, torch add + LayerNorm
  unfused       eager, but every residual add and LayerNorm as separate torch ops (the path
                before the fused Triton add + LayerNorm, ``edserve.layers.add_norm``)
  eager         the engine's default now: contiguous + the Triton row-copy cross K/V writes +
                the prompt through the decode CUDA graphs (``--prompt-cuda-graph-max-tokens``)
                + each residual add fused into the next LayerNorm (one Triton kernel)
  tanh          eager + ``--encoder-gelu tanh`` (bias + GELU in the fc1 GEMM's cuBLASLt
                epilogue, GELU's tanh form: no separate GELU pass)
  tma           tanh + ``--encoder-attention tma`` (the encoder's attention by the Triton
                kernel fed by TMA descriptors instead of SDPA/cuDNN; every other variant
                runs ``sdpa``)
  fa3           tanh + ``--encoder-attention fa3`` (FlashAttention-3's Hopper kernel; needs
                ``EDSERVE_FA3_LIB``, tools/build_fa3.sh)
  prompt-eager  eager, but the prompt through an eager decoder pass (the default of wave 4)
  compiled      eager + ``--compile-encoder`` (one torch.compile graph for all layers)
  graphs        eager + ``--encoder-cuda-graph-max-bs`` (the eager encoder in CUDA graphs at
                batch sizes 1, 2, 4, ... up to the largest batch measured)
  fp8           ``--encoder-dtype fp8`` (eager): a copy of the encoder with fp8 linears (the
                activation scaling and the MLP's tanh GELU in one Triton pass per linear)
  fp8-compiled  fp8 + ``--compile-encoder`` (inductor fuses the per-token activation scaling)

Switching is cheap (attributes; the fp8 encoder copy is made once), so runs can alternate.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F

from edserve.layers.add_norm import TORCH_ADD_NORM
from edserve.layers.encoder_attention import set_encoder_attention
from edserve.layers.linear_gelu import set_linear_gelu
from edserve.models.encoder_graphs import EncoderGraphs
from edserve.models.fp8 import fp8_encoder_layers
from edserve.models.whisper_encoder import run_unfused_layer

VARIANTS = ("before", "contiguous", "unfused", "eager", "tanh", "tma", "fa3", "prompt-eager",
            "compiled", "graphs", "fp8", "fp8-compiled")
TORCH_NORM_VARIANTS = ("before", "contiguous", "unfused")  # separate torch adds and norms


def transposed_layout_forward(self, mel: torch.Tensor) -> torch.Tensor:
    """WhisperEncoder.forward before the layout fix (kept here to measure it)."""
    x = F.gelu(self.conv1(mel))
    x = F.gelu(self.conv2(x)).transpose(1, 2)
    x = x + self.embed_positions.weight[: x.shape[1]]
    for layer in self.layers:
        x = run_unfused_layer(layer, x)
    return self.layer_norm(x)


class Variants:
    """Puts ``engine`` into one of :data:`VARIANTS` (:meth:`use`)."""

    def __init__(self, engine, compile_backend: str, fp8: bool, graph_max_bs: int) -> None:
        """``fp8``: make the fp8 encoder copy now (before anything is compiled);
        ``graph_max_bs``: the largest batch the ``graphs`` path captures."""
        self.engine = engine
        self.graph_max_bs = graph_max_bs
        self.graphs: EncoderGraphs | None = None
        self.inner = engine.model.model  # holds .encoder
        self.bf16 = self.inner.encoder
        self.fp8 = None
        if fp8:
            self.fp8 = copy.deepcopy(self.bf16)
            fp8_encoder_layers(self.fp8)
        self.backend = compile_backend
        self.compiled_fns: dict[int, object] = {}  # id(encoder) -> its compiled layer function
        self.prompts = getattr(engine.runner.graph_runner, "prompts", None)
        self.prompt_tokens = self.prompts.max_tokens if self.prompts is not None else 0
        pool = engine.pools.kv_pool
        self.can_write_kernel = pool.dtype != torch.float8_e4m3fn

    def use(self, name: str) -> None:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
        enc = self.fp8 if name.startswith("fp8") else self.bf16
        if enc is None:
            raise ValueError("build Variants with fp8=True to use the fp8 variants")
        self.inner.encoder = enc
        enc.__dict__.pop("forward", None)
        enc.add_norm = TORCH_ADD_NORM if name in TORCH_NORM_VARIANTS else None
        set_linear_gelu(enc, "tanh" if name in ("tanh", "tma", "fa3", "fp8", "fp8-compiled")
                        else "exact")
        set_encoder_attention(enc, name if name in ("tma", "fa3") else "sdpa")
        if name == "before":
            enc.forward = types.MethodType(transposed_layout_forward, enc)
        self.engine.pools.kv_pool.write_kernel = self.can_write_kernel and \
            name not in ("before", "contiguous")
        if not name.endswith("compiled"):
            enc.uncompile_layers()
        elif id(enc) in self.compiled_fns:  # reuse the wrapper: its graphs stay cached
            enc.run_layer, enc.compiled = self.compiled_fns[id(enc)], True
        else:
            enc.compile_layers(backend=self.backend)
            self.compiled_fns[id(enc)] = enc.run_layer
        if self.prompts is not None:
            self.prompts.max_tokens = 0 if name == "prompt-eager" else self.prompt_tokens
        model = self.engine.model
        model.encoder_graphs = None
        if name == "graphs":
            if self.graphs is None:  # captures the eager bf16 encoder set up above
                cfg = model.config
                self.graphs = EncoderGraphs(
                    enc, self.graph_max_bs, (cfg.num_mel_bins, 2 * cfg.max_source_positions),
                    enc.layer_norm.weight.dtype, enc.layer_norm.weight.device)
            model.encoder_graphs = self.graphs
