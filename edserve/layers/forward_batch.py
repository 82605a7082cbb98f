"""The per-step batch handed from the scheduler to the model runner and attention backend.

All per-batch state lives here (no globals): index tensors built by the scheduler, and the
attention metadata a backend builds once per batch (``attn_metadata``).

Row layout of ``req_to_token[row]`` (one request)::

    column:  0 ...... encoder_lens[i] ... encoder_offsets[i] ...... encoder_offsets[i] + seq_lens[i]
             | encoder KV (cross) | pad (aligned) | decoder KV (self-attention) |

``encoder_offsets[i]`` is where the decoder region starts: ``encoder_lens[i]`` for the ragged and
flat strategies, ``ceil_align(encoder_lens[i], page_size)`` for aligned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from edserve.mem_cache.kv_pool import KVPool


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: encoder KV written, decoder prompt tokens processed
    DECODE = auto()  # one new decoder token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    req_pool_indices: torch.Tensor  # [B] int64: rows of req_to_token
    seq_lens: torch.Tensor  # [B] int32: decoder tokens cached after this step
    prefix_lens: torch.Tensor  # [B] int32: decoder tokens cached before this step
    cu_q: torch.Tensor  # [B+1] int32: offsets of each request's new tokens in q
    max_q: int  # longest new-token run (1 for decode)
    positions: torch.Tensor  # [T] int64: decoder position of each new token
    out_cache_loc: torch.Tensor  # [T] int64: KV slot of each new decoder token
    encoder_lens: torch.Tensor  # [B] int32: encoder tokens per request (0 = none)
    encoder_offsets: torch.Tensor  # [B] int32: column where the decoder region starts
    req_to_token: torch.Tensor  # [rows, cols] int32: the request-to-token table (shared)
    kv_pool: KVPool
    # The edserve.layers.attention backend that reads this batch (typed loosely: this leaf
    # module imports nothing that imports it back).
    attn_backend: Any
    page_size: int
    # Slots where this step's freshly projected cross K/V go, concatenated over the requests
    # whose encoder runs in this step (prefill only): [sum encoder_lens] int64, else None.
    encoder_out_cache_loc: torch.Tensor | None = None
    # Host copies (no device syncs needed to read them).
    seq_lens_cpu: list[int] = field(default_factory=list)
    encoder_lens_cpu: list[int] = field(default_factory=list)
    q_starts_cpu: list[int] = field(default_factory=list)  # [B] cu_q[:-1] on the host
    # Optional per-query-token visible encoder key range [T, 2] (start, end) for models whose
    # text tokens see only part of the encoder output (Mllama); None = all encoder keys.
    cross_kv_ranges: torch.Tensor | None = None
    attn_metadata: Any = None  # built by attn_backend.init_forward_metadata(self)
    # True when the batch is captured in / replayed from a CUDA graph: backends must build
    # fixed-shape metadata from device tensors only (no host lists, no syncs).
    static_shapes: bool = False
    # Host: lengths of the runs of consecutive rows that share one encoder region (a beam
    # group's rows); None when every run is one row. See :meth:`cross_view`.
    cross_runs: list[int] | None = None
    # Decode with the grouped cross-attention kernel: [B, MAX_GROUP_ROWS] int64, row g lists
    # the batch rows of group g (they share the encoder region of the first), -1 padding;
    # unused groups are all -1, a row without a group is a group of one. None: per-row reads.
    cross_groups: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def cross_view(self) -> ForwardBatch | None:
        """The batch as cross-attention sees it when rows share an encoder region: one entry
        per run (its first row stands for all: their encoder K/V hold the same values), whose
        queries are the run's tokens, so the shared encoder K/V are read once per run. Built
        by the eager path only (CUDA graphs read per row). None without runs."""
        runs = self.cross_runs
        if runs is None:
            return None
        cu = [0]
        for n in runs:
            cu.append(cu[-1] + n)
        starts = cu[:-1]
        pinned = self.req_to_token.device.type == "cuda"
        host = torch.tensor(starts + cu, dtype=torch.int64, pin_memory=pinned)
        idx, cu_t = host.to(self.req_to_token.device, non_blocking=True).split(
            [len(starts), len(cu)])
        return dataclasses.replace(
            self, req_pool_indices=self.req_pool_indices.index_select(0, idx),
            seq_lens=torch.zeros_like(idx), prefix_lens=torch.zeros_like(idx),
            cu_q=cu_t.to(torch.int32), max_q=max(runs),
            encoder_lens=self.encoder_lens.index_select(0, idx),
            encoder_offsets=self.encoder_offsets.index_select(0, idx),
            seq_lens_cpu=[0] * len(starts),
            encoder_lens_cpu=[self.encoder_lens_cpu[i] for i in starts],
            q_starts_cpu=starts, attn_metadata=None, cross_runs=None, cross_groups=None)
