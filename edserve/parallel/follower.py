"""Ranks 1..N-1 of a tensor-parallel group: ``python -m edserve.parallel.follower``.

A follower runs no scheduler: it reads rank 0's calls from stdin (:mod:`edserve.parallel.wire`)
and runs each on its model shard and KV pool shard, in order, so every collective meets its
counterpart on rank 0. Calls: ``build`` (load the shard; drop the pool), ``encode``,
``forward``, ``logits``, ``copy_slots``, ``check`` (report integrity on the process group) and
``digest`` (report the KV shard's checksums).
EOF at stdin (rank 0 closed the pipe or died) leaves the group and exits.

Integrity (with ``--debug-checks``: checked on every forward, reported by ``check``): the slots
a batch writes are inside the pool and distinct, and every slot its attention reads has been
written on this rank (a follower that missed a write would read a stale slot).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from edserve.layers.attention import create_backend
from edserve.mem_cache import KVPool
from edserve.parallel.distributed import (
    ENV_DEVICE,
    ENV_RANK,
    ENV_WORLD,
    destroy_group,
    init_group,
)
from edserve.parallel.mirror import batch_from_message, kv_digest, read_slots
from edserve.parallel.shard import load_shard
from edserve.parallel.wire import Message, read_message, recv_tensors

logger = logging.getLogger("edserve")


class Follower:
    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.model: Any = None
        self.pool: KVPool | None = None
        self.backend: Any = None
        self.geometry: dict[str, Any] | None = None
        self.written: torch.Tensor | None = None  # [pool buffer slots] bool
        self.encoded: torch.Tensor | None = None  # the last encode call's states, concatenated
        self.calls = 0
        self.errors: list[str] = []
        self.debug = False  # check every step's slots (the engine's --debug-checks)

    def handle(self, msg: Message) -> None:
        tensors = recv_tensors(msg.specs, self.device) if msg.specs else []
        getattr(self, f"_{msg.kind}")(msg.meta, tensors)

    def _build(self, meta: dict[str, Any], _: list) -> None:
        self.model = self.pool = self.geometry = self.written = self.encoded = None
        self.calls, self.errors, self.debug = 0, [], bool(meta["debug_checks"])
        if self.device.type == "cpu":
            torch.set_num_threads(meta["threads"])
        self.model, _ = load_shard(meta, self.rank, self.world, self.device)

    def _encode(self, meta: dict[str, Any], _: list) -> None:
        states = self.model.encode(meta["inputs"])
        self.encoded = torch.cat(states) if states else None

    def _forward(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.calls += 1
        self._ensure_pool(meta["geometry"])
        input_ids, positions, batch = batch_from_message(meta, tensors, self.pool, self.backend)
        if self.debug:
            self._check_batch(batch)
        batch.attn_backend.init_forward_metadata(batch)
        enc = self.encoded if meta["has_encoder_states"] else None
        self.encoded = None
        self.model(input_ids, positions, batch, enc)

    def _logits(self, _: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.model.compute_logits(tensors[0])

    def _copy_slots(self, _: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        src, dst = (t.to(self.pool.device) for t in tensors)
        self.pool.copy_slots(src, dst)
        self.written[dst] = self.written[src]  # a copy of a written slot counts as written

    def _check(self, meta: dict[str, Any], _: list) -> None:
        errors = list(self.errors)
        if self.calls != meta["calls"]:
            errors.append(f"rank {self.rank} ran {self.calls} forward calls, rank 0 sent "
                          f"{meta['calls']}")
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, errors)

    def _digest(self, _: dict[str, Any], __: list) -> None:
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, kv_digest(self.pool).cpu() if self.pool else None)

    def _ensure_pool(self, geometry: dict[str, Any]) -> None:
        if geometry == self.geometry:
            return
        g = geometry
        self.pool = KVPool(g["num_slots"], g["page_size"], g["num_layers"], g["num_kv_heads"],
                           g["head_dim"], g["dtype"], self.device)
        self.backend = create_backend(g["strategy"], g["page_size"], g["ops"])
        self.written = torch.zeros(self.pool.num_buffer_slots, dtype=torch.bool,
                                   device=self.device)
        self.geometry = geometry

    def _check_batch(self, batch) -> None:
        """Mark the step's writes, then check its reads (see the module docstring)."""
        new = [t for t in (batch.out_cache_loc, batch.encoder_out_cache_loc) if t is not None]
        writes = torch.cat([t.long() for t in new]) if new else torch.empty(0, dtype=torch.long)
        n = self.pool.num_buffer_slots
        if writes.numel() and (int(writes.min()) < self.pool.page_size or int(writes.max()) >= n
                               or writes.unique().numel() != writes.numel()):
            self.errors.append(f"rank {self.rank}, call {self.calls}: the step writes slots "
                               "outside the pool or one slot twice")
            return
        self.written[writes] = True
        reads = read_slots(batch)
        if reads.numel() and not bool(self.written[reads].all()):
            self.errors.append(f"rank {self.rank}, call {self.calls}: attention reads "
                               f"{int((~self.written[reads]).sum())} slots never written here")


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    device = torch.device(os.environ[ENV_DEVICE])
    init_group(rank, world, device, int(os.environ["MASTER_PORT"]))
    follower = Follower(rank, world, device)
    stdin = sys.stdin.buffer
    try:
        with torch.inference_mode():
            while (msg := read_message(stdin)) is not None:
                try:
                    follower.handle(msg)
                except Exception:  # rank 0 fails the same batch; stay in step with it
                    logger.error("tensor-parallel rank %d: %s call failed:\n%s", rank,
                                 msg.kind, traceback.format_exc())
                    follower.errors.append(f"rank {rank}: {msg.kind} call failed")
    finally:
        destroy_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
