"""A prefill's prompt through the decode CUDA graphs: every prompt token a graph row.

A Whisper prefill step runs the encoder, writes every layer's cross K/V into the pool and then
passes the requests' prompts (``<|startoftranscript|>`` ... , 1-4 tokens, more with a text
prompt) through the decoder. Eagerly, that decoder pass launches ~25 kernels per layer from
Python (large-v3: ~40 ms of host time at batch 1 against ~1 ms of device work), so small
prefill batches are bound by the host and hold up every decoding row behind them.

Here the prompt runs as a decode step instead, through the graphs already captured for
decoding, with one graph row per prompt token (a *token row*): token ``k`` of a request is a
row of that request's pool row, with its position and KV slot taken from the extend batch and
``seq_len = prefix + k + 1``. A decode step writes every row's K/V before any row reads, layer
by layer, so a token row attends to exactly the keys it sees in the extend pass: the cross K/V
of its request and its own prompt up to itself, even when the tokens before it are rows of
the same replay. The rows are laid out position-major (every request's token 0, then token
1, ...), and a prefill takes ``ceil(prompt tokens / largest graph)`` replays (one for the
usual batch) rather than one per prompt position: at one request, a 4-token prompt costs one
decode step instead of four. The logits of each request's last token row (and of its
no-speech position) are kept. Results equal the eager extend pass up to the kernels' rounding
(tested against it on the CPU, where the same static forward runs without a graph).

A mixed step (``--mixed-steps``: rows already decoding take their next token beside the
new rows) replays the same way: a decoding row is a row whose prompt is its one new token (its
K/V slot, position and length are the extend batch's). Used for models without per-row key
ranges whose prompts have at most ``max_tokens`` tokens and whose batch fits the largest
graph; any other step takes the eager pass. Host work is one upload of index lists; no sync.
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
        # Every prompt token is a graph row of its own ("token rows"), position-major, so a
        # token's earlier tokens sit in the same replay or an earlier one.
        tokens = [(i, k) for k in range(max(lens)) for i in range(B) if lens[i] > k]
        wanted: dict[tuple[int, int], list[int]] = {}
        for p, key in enumerate(picks):  # a pick lies inside its row's prompt (checked on
            wanted.setdefault(key, []).append(p)  # the request), so it is a token row
        # Host index lists of every replay, uploaded at once: its token rows (pool row, index
        # in the extend layout, k + 1) and where finished rows' / picks' logits go.
        plan: list[tuple[int, int, int, int]] = []  # (rows, ends, picks, offset) per replay
        flat: list[int] = []
        cap = self.sizes[-1]
        for c in range(0, len(tokens), cap):
            chunk = tokens[c:c + cap]
            ends = [(j, i) for j, (i, k) in enumerate(chunk) if k == lens[i] - 1]
            got = [(j, p) for j, key in enumerate(chunk) for p in wanted.get(key, ())]
            plan.append((len(chunk), len(ends), len(got), len(flat)))
            flat += [i for i, _ in chunk] + [starts[i] + k for i, k in chunk]
            flat += [k + 1 for _, k in chunk]
            flat += [j for j, _ in ends] + [i for _, i in ends]
            flat += [j for j, _ in got] + [p for _, p in got]
        idx = to_device(flat, torch.int64, input_ids.device)
        logits = picked = None
        for n, e, g, at in plan:
            sel, tok, upto = idx[at:at + n], idx[at + n:at + 2 * n], idx[at + 2 * n:at + 3 * n]
            at += 3 * n
            out = self._replay(batch, input_ids, sel, tok, upto)  # [n, V]
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
                tok: torch.Tensor, upto: torch.Tensor) -> torch.Tensor:
        """Token rows as one decode step: prompt token ``tok`` (index in the extend layout) of
        pool row ``sel``, seeing its row's first ``prefix + upto`` keys (itself included: every
        token row writes its K/V before any reads, layer by layer). Returns the logits
        ``[n, V]``, a view of the graph's output buffer (read before the next replay: stream
        order keeps that safe)."""
        n = sel.shape[0]
        padded = padded_size(self.sizes, n)
        seq = (batch.prefix_lens.index_select(0, sel) + upto).to(torch.int32)  # [n]
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
