"""The collectives a tensor-parallel layer calls, behind one small interface, so a layer does
not care how its ranks talk: :class:`TorchComm` (``torch.distributed``: NCCL on CUDA, gloo on
CPU) in the engine; tests may run the ranks of one split as threads of one process."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Comm(Protocol):
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks (in place); returns ``t``."""

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""


class TorchComm:
    """``torch.distributed`` collectives over ``group`` (None: the default group)."""

    def __init__(self, world: int, group=None) -> None:
        self.world, self.group = world, group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts
