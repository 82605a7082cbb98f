"""Load the model on one rank and keep its shard (rank 0 and the followers run the same code).

``spec`` (sent to the followers in the ``build`` call): ``model`` (the ``--model`` value),
``checkpoint`` (None: load ``model``; a :class:`~edserve.models.weights.Checkpoint`, pickled to
the followers; or a picklable zero-argument callable returning one, called on every rank, e.g.
a benchmark's seeded random weights), ``dtype`` (a ``torch`` dtype name), ``debug_checks``
(the followers check every step's KV slots), ``threads`` (rank 0's CPU threads: on CPU every
rank runs with as many).
"""

from __future__ import annotations

from typing import Any

import torch

from edserve.models.weights import load_checkpoint
from edserve.parallel.comm import TorchComm
from edserve.parallel.load import load_model_shard


def make_spec(model: str | None, checkpoint: Any, dtype: torch.dtype,
              debug_checks: bool = False) -> dict[str, Any]:
    return {"model": model, "checkpoint": checkpoint, "dtype": str(dtype).removeprefix("torch."),
            "debug_checks": debug_checks, "threads": torch.get_num_threads()}


def load_shard(spec: dict[str, Any], rank: int, world: int,
               device: torch.device) -> tuple[Any, Any]:
    """(this rank's model shard on ``device``, tokenizer), loaded a layer at a time
    (:mod:`edserve.parallel.load`)."""
    ckpt = spec["checkpoint"]
    if ckpt is None:
        ckpt = load_checkpoint(spec["model"])
    elif callable(ckpt):
        ckpt = ckpt()
    return load_model_shard(ckpt, getattr(torch, spec["dtype"]), device, rank,
                            TorchComm(world))
