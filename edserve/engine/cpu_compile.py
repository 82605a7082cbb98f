"""Compiled CPU decode steps (``--cpu-compile``): the decoder forward, the logits and (for the
plans :mod:`edserve.engine.cpu_sample` takes) the sampling of a decode batch as one
``torch.compile`` graph (inductor's C++/OpenMP backend) per batch shape and sampling key.

The CPU counterpart of :mod:`edserve.engine.cuda_graph`, with the same interface (``can_run``,
``step``): a decode batch is copied into the static buffers of
:class:`~edserve.engine.graph_inputs.GraphInputs` and padded to a shape bucket, ``G`` groups of
``W`` rows (``W`` = 1: greedy rows; ``W`` = beam width: beam groups, whose rows share an encoder
region read once per group; see :mod:`edserve.layers.attention.static_decode`). The decoder
region's key count is the graph's one free dimension (marked dynamic), so a bucket compiles
once. Batches of another form (mixed group widths, Mllama key ranges) run eagerly.

Compiling costs seconds (inductor's on-disk cache, ``TORCHINDUCTOR_CACHE_DIR``, makes later
processes faster, but dynamo still traces), which a short job never earns back: a bucket is
compiled only after it has run ``compile_after`` eager decode steps (``auto``: 2048), so one
short clip runs eagerly as before and long or many clips switch to the compiled step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from edserve.engine.batch_builder import Pools
from edserve.engine.cpu_sample import SamplingKeys
from edserve.engine.graph_inputs import GraphInputs
from edserve.engine.graph_names import stable_graph_name
from edserve.engine.host_copy import to_device
from edserve.engine.sampler import SamplingPlan, sample
from edserve.engine.token_history import TokenHistory
from edserve.layers.attention.static_decode import StaticDecodeBackend, static_decode_metadata
from edserve.layers.forward_batch import ForwardBatch, ForwardMode
from edserve.models import int8_native

logger = logging.getLogger("edserve")

SELF_COLS_ALIGN = 16  # decoder key count rounded up to this (fewer distinct shapes)
# Most groups whose encoder regions a graph reads in place (one SDPA call per group and layer);
# a batch of more groups gathers them (one call per layer).
CROSS_VIEW_MAX_GROUPS = 16
ANCHORS_KEPT = 4096  # (row, generation) entries of the anchor cache before it starts over
_RUNNERS = itertools.count()  # runners made in this process


def group_buckets(max_bs: int) -> list[int]:
    """Group counts compiled: 1, 2, 4, 8, ... up to ``max_bs``."""
    sizes, g = [], 1
    while g < max_bs:
        sizes.append(g)
        g *= 2
    return sizes + [max_bs]


def batch_width(batch: ForwardBatch) -> int | None:
    """Rows per group when every run of rows sharing an encoder region has the same length
    (1 without runs), else None."""
    runs = batch.cross_runs
    if runs is None:
        return 1
    return runs[0] if all(n == runs[0] for n in runs) else None


def _dynamic_size(n: int) -> torch.Tensor:
    """An empty ``[n, 0]`` tensor whose first size is marked dynamic: it carries ``n`` into a
    compiled graph as a symbol, without a recompile per value."""
    t = torch.empty(n, 0)
    torch._dynamo.mark_dynamic(t, 0)
    return t


class CompiledDecodeRunner:
    """Decode batches through compiled graphs, keyed by ``(G, W)`` (padded groups, width)."""

    # Inductor's C++ wrapper: the graph's ~100 kernel and op calls made from C++, not from a
    # generated Python function (int8 tiny.en greedy step 2.36 -> 2.13 ms, beam 5 3.89 -> 3.66,
    # bf16 greedy 4.31 -> 4.00; first compile ~12 s against ~8; benchmarks/RESULTS.md, wave 31)
    cpp_wrapper = True

    def __init__(self, model: torch.nn.Module, pools: Pools, max_bs: int, max_encoder_len: int,
                 max_decoder_len: int, compile_after: int, cache_dir: Path | None,
                 backend: str = "inductor", sampling: bool = True,
                 native_int8: bool = True) -> None:
        """``backend``: torch.compile's (tests trace with ``"eager"``: dynamo, no codegen);
        ``sampling``: sample inside the compiled graphs too (:mod:`.cpu_sample`);
        ``native_int8``: int8 linears called as the native op (built at the first compile,
        :mod:`edserve.models.int8_native`), else through the opaque op."""
        if pools.backend.name not in ("flat", "aligned"):
            raise ValueError(f"--cpu-compile needs fixed shapes: use --encoder-kv flat or "
                             f"aligned, not {pools.backend.name}")
        self.model, self.pools, self.max_bs = model, pools, max_bs
        self.compile_after, self.compiler = compile_after, backend
        self.encoder_cols = max_encoder_len  # encoder keys sit in columns [0, encoder_len)
        self.inputs = GraphInputs(max_bs, pools.device, ranged=False)
        self.backend = StaticDecodeBackend()
        self.cols = torch.arange(max_decoder_len + SELF_COLS_ALIGN, device=pools.device)
        self.encoder_col_ids = torch.arange(max_encoder_len, device=pools.device)
        self.buckets = group_buckets(max_bs)
        self.eager_steps: dict[tuple[int, int], int] = {}  # steps run eagerly per key
        # (G, W, cross read in place, sampling key or None) of each graph compiled
        self._compiled: dict[tuple[int, int, bool, tuple | None], Callable] = {}
        self.cross_view = True  # encoder regions read in place when they allow it
        # (row, generation) -> that hold's encoder-region anchor, None: not one run of slots
        self._anchors: dict[tuple[int, int], torch.Tensor | None] = {}
        # anchor size -> padding groups' anchors of that size, distinct tensors made once
        # (a marked-dynamic tensor costs ~38 us to make: up to 15 a step in a part-filled bucket)
        self._padding: dict[int, list[torch.Tensor]] = {}
        # Graph inputs whose size is the graph's free dimension, made and marked dynamic once
        # (graphs are called without guards: an input unmarked when its graph was made would
        # have its size baked in)
        self._self_cols: dict[int, torch.Tensor] = {}  # key count -> cols[:k]
        self.steps = 0  # decode steps run compiled
        self.sampling = SamplingKeys() if sampling else None
        self.sampled_steps = 0  # of which sampled inside the graph
        self.cache_dir = cache_dir
        self.native_int8 = native_int8  # attached at the first compile (then None: done)
        self.index = next(_RUNNERS)  # this process's n-th runner (its graphs' names)
        self.native_linears = 0  # int8 linears called as the native op
        if cache_dir is not None:  # inductor reads it when it first compiles
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))

    @property
    def graphs(self) -> set[tuple[int, int, bool, tuple | None]]:
        """``(G, W, cross read in place, sampling key or None)`` of each graph compiled."""
        return set(self._compiled)

    @property
    def variants(self) -> set[tuple[int, int, bool]]:
        """The ``(G, W, cross read in place)`` variants compiled (with or without sampling)."""
        return {k[:3] for k in self.graphs}

    @property
    def compiled(self) -> set[tuple[int, int]]:
        """The ``(G, W)`` keys compiled (in either variant)."""
        return {k[:2] for k in self.graphs}

    def key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """``(G, W)`` bucket of a decode batch, or None when it must run eagerly."""
        if batch.mode != ForwardMode.DECODE or batch.cross_kv_ranges is not None \
                or batch.batch_size > self.max_bs:
            return None
        width = batch_width(batch)
        if width is None:
            return None
        groups = batch.batch_size // width
        g = next((s for s in self.buckets if s >= groups and s * width <= self.max_bs), None)
        return None if g is None else (g, width)

    def can_run(self, batch: ForwardBatch, plan: SamplingPlan | None = None) -> bool:
        """Whether ``batch`` (sampled by ``plan``) runs compiled now; counts eager steps
        towards ``compile_after``. The first step of a sampling key runs eagerly (it builds the
        filters' tensors; the next step compiles the graph that samples too), so a bucket does
        not also compile a graph without sampling that it would use for one step."""
        key = self.key(batch)
        if key is None:
            return False
        n = self.eager_steps.get(key, 0)
        if n <= self.compile_after:  # counted until the key is due (then it stays due)
            self.eager_steps[key] = n = n + 1
            if n <= self.compile_after:
                return False
        return self.sampling is None or plan is None \
            or not self.sampling.first_step(plan, key[0] * key[1])

    def _forward(self, g: int, w: int, self_cols: torch.Tensor,
                 cross_anchors: tuple[torch.Tensor, ...] | None, plan: SamplingPlan | None,
                 history: TokenHistory) -> torch.Tensor | tuple:
        """The compiled work: metadata, decoder forward and logits of ``g * w`` rows;
        ``cross_anchors``: each group's encoder region's first slot as a dynamic size (see
        :meth:`_cross_anchors`), or None. Returns the logits ``[g * w, V]``, or with a
        ``plan`` what :func:`~edserve.engine.sampler.sample` returns for all ``g * w`` rows
        (padding rows append to the token history's padding row 0)."""
        bs = g * w
        inp = self.inputs
        batch = inp.batch(self.pools, bs)
        batch.attn_backend = self.backend
        firsts = None if cross_anchors is None else [a.shape[0] - 2 for a in cross_anchors]
        batch.attn_metadata = static_decode_metadata(batch, self_cols, self.encoder_cols, w,
                                                     firsts)
        hidden = self.model(inp.input_ids[:bs], inp.positions[:bs], batch, None)  # [bs, d]
        logits = self.model.compute_logits(hidden)  # [bs, V]
        return logits if plan is None else sample(logits, plan, history, inp.rows[:bs])

    def _cross_anchors(self, batch: ForwardBatch, g: int, w: int
                       ) -> tuple[torch.Tensor, ...] | None:
        """When every group's encoder region fills the ``encoder_cols`` columns with one run of
        slots (and there are at most :data:`CROSS_VIEW_MAX_GROUPS` groups), one tensor per group
        of the bucket, of shape ``[first + 2, 0]`` (no storage): its marked-dynamic size carries
        the group's first slot into the graph without a recompile per value (+2: dynamo
        specialises sizes 0 and 1); padding groups get tensors of their own, of the first
        group's size. Else None (the graph gathers). A row's answer is worked out once per hold
        of the row (its encoder columns are written at its request's prefill only): kept by
        (row, generation)."""
        n = batch.batch_size // w  # real groups
        if not self.cross_view or g > CROSS_VIEW_MAX_GROUPS or any(
                batch.encoder_lens_cpu[i * w] != self.encoder_cols for i in range(n)):
            return None
        generation = self.pools.req_to_token_pool.generation
        keys = [(r, generation[r]) for r in batch.req_pool_indices[::w].tolist()]
        missing = [k for k in keys if k not in self._anchors]
        if missing:
            self._remember_anchors(batch.req_to_token, missing)
        found = [self._anchors[k] for k in keys]
        if any(a is None for a in found):
            return None
        # padding groups: tensors of their own (a graph made with one tensor twice among its
        # inputs reads that input for both; called without guards, it would not notice)
        size = found[0].shape[0]
        pads = self._padding.setdefault(size, [])
        pads += [_dynamic_size(size) for _ in range(g - n - len(pads))]
        return tuple(found + pads[:g - n])

    def _remember_anchors(self, req_to_token: torch.Tensor, keys: list[tuple[int, int]]) -> None:
        """Work out the anchors of the rows of ``keys`` (one gather and check for all)."""
        if len(self._anchors) + len(keys) > ANCHORS_KEPT:
            self._anchors.clear()  # entries of rows held by earlier requests
            self._padding.clear()
        rows = to_device([r for r, _ in keys], torch.int64, req_to_token.device)
        table = req_to_token[rows, :self.encoder_cols].long()  # [m, E]
        one_run = ((table - table[:, :1]) == self.encoder_col_ids).all(dim=1).tolist()
        for key, run, first in zip(keys, one_run, table[:, 0].tolist(), strict=True):
            self._anchors[key] = _dynamic_size(first + 2) if run else None

    def _compile(self, variant: tuple, example: tuple) -> Callable:
        """One graph of :meth:`_forward` for ``variant`` and ``example`` (its arguments), as a
        function that runs it without dynamo's frame hook or guards (``aot_compile``: a dynamo
        call cost ~0.1 ms of a ~2.8 ms int8 tiny.en step, even with guard evaluation skipped).
        The caller keys graphs by variant; sizes marked dynamic stay free; the variant's other
        inputs must keep the shapes, dtypes and aliasing of ``example``. Inductor writes the
        graph's wrapper in C++ (:attr:`cpp_wrapper`); the graph's name is the same in every
        process that compiles alike (:mod:`.graph_names`: inductor's disk cache then serves)."""
        if self.native_int8:  # once, before the first trace
            self.native_linears = int8_native.attach(self.model, self.cache_dir)
            self.native_int8 = None
        options = {"cpp_wrapper": self.cpp_wrapper} if self.compiler == "inductor" else None
        g, w, view, skey = variant
        nth = sum(1 for v in self._compiled if v[:3] == variant[:3] and v[3] is not None)
        name = f"edserve{self.index}_{g}x{w}{'v' if view else 'g'}_{'s' if skey else 'l'}{nth}"
        named = f"__compiled_fn_{name}" not in globals()  # dynamo installs the graph here
        with stable_graph_name(name) if named else contextlib.nullcontext():
            made = torch.compile(self._forward, backend=self.compiler, dynamic=False,
                                 fullgraph=True, options=options).aot_compile((example, {}))
        return types.MethodType(made.fn, self)  # its function takes the runner first

    def step(self, batch: ForwardBatch, input_ids: torch.Tensor, plan: SamplingPlan,
             history: TokenHistory) -> tuple[torch.Tensor | None, tuple | None]:
        """``(logits [B, V], None)`` of a decode batch that :meth:`can_run` accepted, for the
        caller to sample; or ``(None, (tokens [B], log-probs [B], candidates))`` sampled in the
        graph by ``plan`` (:mod:`.cpu_sample`), appended to ``history``."""
        g, w = self.key(batch)
        bs = batch.batch_size
        picked = None if self.sampling is None else self.sampling.plan_for(plan, g * w)
        skey, own = picked or (None, None)
        self.inputs.load(batch, input_ids, g * w)
        k = -(-max(batch.seq_lens_cpu) // SELF_COLS_ALIGN) * SELF_COLS_ALIGN
        self_cols = self._self_cols.get(k)
        if self_cols is None:
            self_cols = self._self_cols[k] = self.cols[:k]
            torch._dynamo.mark_dynamic(self_cols, 0)
        anchors = self._cross_anchors(batch, g, w)
        variant = (g, w, anchors is not None, skey)
        fn = self._compiled.get(variant)
        first = fn is None
        t0 = time.perf_counter()
        if first:
            fn = self._compiled[variant] = self._compile(
                variant, (g, w, self_cols, anchors, own, history))
        out = fn(g, w, self_cols, anchors, own, history)
        self.steps += 1
        if first:
            logger.info("compiled the CPU decode step for %d group(s) of %d row(s)%s%s in %.1f s",
                        g, w, " (encoder K/V in place)" if variant[2] else "",
                        "" if own is None else " with its sampling", time.perf_counter() - t0)
        if own is None:
            return out[:bs], None
        self.sampled_steps += 1
        tokens, logprobs, cands = out
        return None, (tokens[:bs], logprobs[:bs], cands)
