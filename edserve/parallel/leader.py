"""Rank 0's model: the engine calls it like the unsplit model; every call that runs collectives
(``encode``, ``forward``, ``compute_logits``) and every KV copy is first handed to the other
ranks, which run the same call on their shard (:mod:`edserve.parallel.follower`).

The scheduler, the request-to-token table and the KV allocator live only on rank 0; a forward
call carries the step's index tensors and table rows (:mod:`edserve.parallel.mirror`), so every
rank writes and reads the same KV slots of its own pool shard.
"""

from __future__ import annotations

from typing import Any

import torch

from edserve.parallel.distributed import rank_device
from edserve.parallel.errors import TensorParallelError
from edserve.parallel.mirror import batch_message, kv_digest
from edserve.parallel.session import TPSession, get_session
from edserve.parallel.shard import load_shard, make_spec
from edserve.parallel.tp import kv_heads_per_rank


class TensorParallelModel:
    """Rank 0's shard of the model, behind the model's engine contract (other attributes are
    the wrapped model's). ``num_kv_heads`` is per rank: the KV pools are sized from it."""

    def __init__(self, model: Any, session: TPSession, generation: int) -> None:
        self.model = model
        self.session = session
        self.generation = generation
        self.num_kv_heads = kv_heads_per_rank(model, session.world)
        self._pools: list[Any] = []  # KV pools whose copies are mirrored

    def __getattr__(self, name: str) -> Any:  # config, encoder_len, max_decoder_len, ...
        return getattr(self.__dict__["model"], name)

    @property
    def current(self) -> bool:
        """False once the group was shut down or a newer engine rebuilt the other ranks."""
        return self.generation == self.session.generation

    @property
    def tensor_parallel_size(self) -> int:
        return self.session.world

    def _send(self, kind: str, meta: dict[str, Any] | None = None,
              tensors: list[torch.Tensor] | None = None) -> None:
        if not self.current:
            raise TensorParallelError("this engine's tensor-parallel group was shut down, or a "
                                      "newer engine replaced its shards on the other ranks")
        self.session.send(kind, meta, tensors)

    def encode(self, inputs: list[Any]) -> list[torch.Tensor]:
        self._send("encode", {"inputs": inputs})
        return self.model.encode(inputs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch,
                 encoder_states: torch.Tensor | None = None) -> torch.Tensor:
        self._mirror_copies(batch.kv_pool)
        meta, tensors = batch_message(batch, input_ids, positions, encoder_states is not None)
        self._send("forward", meta, tensors)
        self.session.calls += 1
        return self.model(input_ids, positions, batch, encoder_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        self._send("logits", tensors=[hidden])
        return self.model.compute_logits(hidden)

    def _mirror_copies(self, kv_pool) -> None:
        """Hand the pool's copy-on-write copies (beam forks, reused encoder regions) to the
        other ranks too (registered once per pool, before the pool's first forward)."""
        if any(p is kv_pool for p in self._pools):
            return
        self._pools.append(kv_pool)
        kv_pool.copy_observers.append(lambda src, dst: self._send("copy_slots",
                                                                  tensors=[src, dst]))

    def check_followers(self) -> None:
        """Raise :class:`TensorParallelError` if a follower's integrity checks failed (the
        followers of a shut-down or replaced engine hold nothing of it: no check)."""
        if not self.current:
            return
        errors = self.session.check_followers()
        if errors:
            raise TensorParallelError("tensor-parallel followers: " + "; ".join(errors[:5]))

    def kv_digests(self, kv_pool) -> list[torch.Tensor]:
        """Every rank's :func:`~edserve.parallel.mirror.kv_digest` of its KV shard, in rank
        order (rank 0's from ``kv_pool``): ``[layers, heads per rank, 2]`` each."""
        if not self.current:
            raise TensorParallelError("this engine's tensor-parallel group was shut down or "
                                      "replaced")
        return self.session.gather("digest", {}, kv_digest(kv_pool).cpu())

    def close(self) -> None:
        """Stop the follower ranks (the engine cannot step afterwards)."""
        from edserve.parallel.session import shutdown
        shutdown()


def build_sharded_model(config, checkpoint: Any, dtype: torch.dtype,
                        device: torch.device) -> tuple[TensorParallelModel, Any]:
    """Rank 0: start (or reuse) the group of ``config.tensor_parallel_size`` ranks, have every
    rank load its shard, return (rank 0's model, tokenizer)."""
    world = config.tensor_parallel_size
    spec = make_spec(config.model, checkpoint, dtype, config.debug_checks)
    # Rank 0 loads and splits first, so a model that cannot be split fails before any
    # process starts (the followers then load theirs while rank 0 waits at the first call).
    model, tokenizer = load_shard(spec, 0, world, rank_device(device, 0))
    session = get_session(world, device)
    return TensorParallelModel(model, session, session.build(spec)), tokenizer
