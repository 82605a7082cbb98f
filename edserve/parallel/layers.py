"""Tensor-parallel linear layers, made from an already loaded ``nn.Linear`` (Megatron style).

* column-parallel (:func:`shard_columns`): rank ``r`` keeps output rows ``[r n / N, (r+1) n / N)``
  of every part of the (possibly fused) projection, in place: no communication; its output is
  this rank's slice of every part (e.g. its attention heads).
* row-parallel (:class:`RowParallelLinear`): rank ``r`` keeps input columns
  ``[r k / N, (r+1) k / N)``; partial products are summed by one all-reduce, then the bias
  (replicated) is added once.
* vocab-parallel head (:class:`VocabParallelHead`): column-parallel output projection whose
  slices are all-gathered, so every rank ends with the full ``[N, vocab]`` logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edserve.models.weights.fused import FusedLinear
from edserve.parallel.comm import Comm
from edserve.parallel.errors import TensorParallelError


def _chunk(n: int, world: int, what: str) -> int:
    if n % world:
        raise TensorParallelError(f"{what} ({n}) is not divisible by --tensor-parallel-size "
                                  f"{world}")
    return n // world


@torch.no_grad()
def shard_columns(linear: nn.Linear, rank: int, world: int, what: str) -> None:
    """Column-parallel, in place: keep this rank's share of each part's output rows.

    A :class:`FusedLinear` is split part by part (``[q | k | v]`` -> ``[q_r | k_r | v_r]``) and
    its ``parts`` shrink accordingly; a plain linear is one part. Rows are head-major, so a
    contiguous share of a part is a contiguous group of heads."""
    parts = [r for _, r in linear.parts] if isinstance(linear, FusedLinear) \
        else [linear.out_features]
    keep: list[torch.Tensor] = []
    start = 0
    for p in parts:
        n = _chunk(p, world, f"{what}: output rows {p}")
        keep.append(torch.arange(start + rank * n, start + (rank + 1) * n))
        start += p
    rows = torch.cat(keep).to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.index_select(0, rows).contiguous(),
                                 requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, rows).contiguous(),
                                   requires_grad=False)
    linear.out_features = int(rows.numel())
    if isinstance(linear, FusedLinear):
        linear.parts = tuple((name, r // world) for name, r in linear.parts)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: x ``[..., in / N]`` (this rank's columns) ->
    ``[..., out]`` replicated on every rank."""

    def __init__(self, linear: nn.Linear, rank: int, comm: Comm, what: str) -> None:
        super().__init__()
        world = comm.world
        k = _chunk(linear.in_features, world, f"{what}: input columns {linear.in_features}")
        with torch.no_grad():
            self.weight = nn.Parameter(linear.weight[:, rank * k:(rank + 1) * k].contiguous(),
                                       requires_grad=False)  # [out, in / N]
            self.bias = None if linear.bias is None else \
                nn.Parameter(linear.bias.detach().clone(), requires_grad=False)  # [out]
        self.in_features, self.out_features = k, linear.out_features
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))  # [..., out]
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """Output projection split by vocabulary rows; ``[N, H] -> [N, vocab]`` on every rank
    (one all-gather of the ``[N, vocab / world]`` slices)."""

    def __init__(self, linear: nn.Linear, rank: int, comm: Comm, what: str) -> None:
        super().__init__()
        if linear.bias is not None:
            raise TensorParallelError(f"{what}: a vocab-parallel head takes no bias")
        shard_columns(linear, rank, comm.world, what)
        self.weight = linear.weight  # [vocab / N, H]
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [N, vocab / world]
        return torch.cat(self.comm.all_gather(y), dim=-1)
