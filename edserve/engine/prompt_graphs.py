"""A prefill's prompt through the decode CUDA graphs: one replay per prompt position.

A Whisper prefill step runs the encoder, writes every layer's cross K/V into the pool and then
passes the requests' prompts (``<|startoftranscript|>`` ... , 1-4 tokens, more with a text
prompt) through the decoder. Eagerly, that decoder pass launches ~25 kernels per layer from
Python (large-v3: ~40 ms of host time at batch 1 against ~1 ms of device work), so small
prefill batches are bound by the host and hold up every decoding row behind them.

Here the prompt runs as decode steps instead, through the graphs already captured for decoding:
replay ``k`` feeds token ``k`` of every prompt longer than ``k`` (position, KV slot and
``seq_len = prefix + k + 1`` taken from the extend batch), so each token attends to exactly the
keys it sees in the extend pass: the cross K/V of its row and its own prompt up to itself.
Replay ``k`` keeps the logits of the rows whose prompt ends at ``k`` (and of the rows whose
no-speech position is ``k``). Results equal the eager extend pass up to the kernels' rounding
(tested against it on the CPU, where the same static forward runs without a graph).

A mixed step (``--mixed-steps``: rows already decoding take their next token beside the
new rows) replays the same way: a decoding row is a row whose prompt is its one new token, so
it runs in replay 0 (its K/V slot, position and length are the extend batch's) and its logits
are kept there. Used for models without per-row key ranges whose prompts have at most
``max_tokens`` tokens and whose batch fits the largest graph; any other step takes the eager
pass. Host work is one upload of index lists; no sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from edserve.engine.graph_inputs import GraphInputs, padded_size
from edserve.engine.host_copy import to_device
from edserve.layers.forward_batch import ForwardBatch, ForwardMode

#: ``(padded batch size) -> logits [padded, V]`` of the static inputs as loaded: a graph
#: replay on CUDA, :func:`~edserve.engine.graph_inputs.static_forward` elsewhere (tests).
RunStatic = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class PromptOutputs:
    """Logits of a prompt replay: ``logits`` ``[B, V]`` at each row's last prompt token;
    ``picked`` ``[P, V]`` at the positions asked for (``picks``, in the order given)."""

    logits: torch.Tensor
    picked: torch.Tensor | None


class PromptReplayer:
    """Runs prefill prompts as decode-graph replays (see the module docstring)."""

    def __init__(self, inputs: GraphInputs, sizes: list[int], run_static: RunStatic,
                 max_tokens: int) -> None:
        self.inputs = inputs
        self.sizes = sizes  # captured batch sizes, ascending
        self.run_static = run_static
        self.max_tokens = max_tokens

    def accepts(self, batch: ForwardBatch) -> bool:
        """A prefill step whose prompts and batch fit (decided from host values). A mixed
        step's decoding rows are rows with a one-token prompt: they run in the first replay."""
        if batch.mode != ForwardMode.EXTEND or self.max_tokens <= 0:
            return False
        if batch.cross_kv_ranges is not None or self.inputs.ranged:
            return False
        lens = _q_lens(batch)
        return (0 < batch.batch_size <= self.sizes[-1] and min(lens) >= 1
                and max(lens) <= self.max_tokens)

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor,
            picks: list[tuple[int, int]] = ()) -> PromptOutputs:
        """Replay the prompts of ``batch`` (``input_ids`` ``[T]``, extend layout).

        ``picks``: ``(row, token index within the row's prompt)`` whose logits are also wanted
        (Whisper's no-speech position). The cross K/V must already be in the pool."""
        B = batch.batch_size
        lens, starts = _q_lens(batch), batch.q_starts_cpu
        # Host index lists of every replay, uploaded at once: per replay k the rows still in
        # their prompt, their token indices, and where finished rows' / picks' logits go.
        plan: list[tuple[int, int, int, int]] = []  # (rows, ends, picks, offset) per replay
        flat: list[int] = []
        for k in range(max(lens)):
            sel = [i for i in range(B) if lens[i] > k]
            ends = [(j, i) for j, i in enumerate(sel) if lens[i] == k + 1]
            # a pick's position lies inside its row's prompt (GenerateRequest checks it), so
            # its row is still in `sel` at replay `at`
            where = {i: j for j, i in enumerate(sel)}
            got = [(where[i], p) for p, (i, at) in enumerate(picks) if at == k]
            plan.append((len(sel), len(ends), len(got), len(flat)))
            flat += sel + [starts[i] + k for i in sel]
            flat += [j for j, _ in ends] + [i for _, i in ends]
            flat += [j for j, _ in got] + [p for _, p in got]
        idx = to_device(flat, torch.int64, input_ids.device)
        logits = picked = None
        for k, (n, e, g, at) in enumerate(plan):
            sel, tok = idx[at:at + n], idx[at + n:at + 2 * n]
            at += 2 * n
            out = self._replay(batch, input_ids, sel, tok, k)  # [n, V]
            if logits is None:
                logits = out.new_empty((B, out.shape[1]))
                picked = out.new_empty((len(picks), out.shape[1])) if picks else None
            if e:
                logits.index_copy_(0, idx[at + e:at + 2 * e], out[idx[at:at + e]])
            at += 2 * e
            if g:
                picked.index_copy_(0, idx[at + g:at + 2 * g], out[idx[at:at + g]])
        return PromptOutputs(logits, picked)

    def _replay(self, batch: ForwardBatch, input_ids: torch.Tensor, sel: torch.Tensor,
                tok: torch.Tensor, k: int) -> torch.Tensor:
        """Token ``k`` of the rows ``sel`` (``tok``: their indices in the extend layout) as one
        decode step; returns its logits ``[n, V]``, a view of the graph's output buffer (read
        before the next replay: stream order keeps that safe)."""
        n = sel.shape[0]
        padded = padded_size(self.sizes, n)
        seq = (batch.prefix_lens.index_select(0, sel) + (k + 1)).to(torch.int32)  # [n]
        self.inputs.load_rows(
            padded, input_ids.index_select(0, tok), batch.positions.index_select(0, tok),
            batch.req_pool_indices.index_select(0, sel), seq,
            batch.out_cache_loc.index_select(0, tok), batch.encoder_lens.index_select(0, sel),
            batch.encoder_offsets.index_select(0, sel))
        self.inputs.ungrouped(padded)
        return self.run_static(padded)[:n]


def _q_lens(batch: ForwardBatch) -> list[int]:
    """Prompt tokens per row, from the host copy of ``cu_q``."""
    ends = batch.q_starts_cpu[1:] + [batch.num_tokens]
    return [e - s for s, e in zip(batch.q_starts_cpu, ends, strict=True)]
