"""Load a model straight into one rank's shard, a layer at a time, so no device (and no
process) ever holds the whole model: what a model larger than one GPU needs.

The model is built on the ``meta`` device; each split layer is then materialised on the CPU,
filled from the checkpoint (whose safetensors are memory-mapped: pages are read on use and
shared by the ranks' processes), split by the same sharder as
:func:`~edserve.parallel.tp.apply_tensor_parallel` and moved to the rank's device; the rest
(embeddings, norms, projector, head) follows the same way. Peak host memory beyond the mapped
files: one unsplit layer. Loaders are registered per ``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from edserve.models.mllama.config import MllamaConfig
from edserve.models.mllama.loader import load_tokenizer
from edserve.models.mllama.model import MllamaModel
from edserve.models.mllama.rope import rope_inv_freq
from edserve.models.mllama.weights import hf_to_edserve_name
from edserve.models.weights.fused import load_hf_tensors
from edserve.parallel.comm import Comm
from edserve.parallel.errors import TensorParallelError
from edserve.parallel.tp import mllama_layer_units, shard_mllama_head

_CPU = torch.device("cpu")


def _fill(module: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Materialise ``module`` (on ``meta``) on the CPU in ``dtype`` and load ``tensors``."""
    module.to_empty(device=_CPU)
    module.to(dtype)
    load_hf_tensors(module, tensors)


def load_mllama_shard(checkpoint: Any, dtype: torch.dtype, device: torch.device, rank: int,
                      comm: Comm) -> tuple[MllamaModel, Any]:
    """(rank ``rank``'s shard of a Mllama checkpoint on ``device``, the tokenizer)."""
    cfg = MllamaConfig.from_hf(checkpoint.config)
    with torch.device("meta"):
        model = MllamaModel(cfg)
    tensors = {hf_to_edserve_name(k): v for k, v in checkpoint.state_dict.items()}
    units = mllama_layer_units(model)
    for what, layer, shard in units:
        head = what + "."
        _fill(layer, {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)},
              dtype)
        shard(layer, rank, comm, what)
        layer.to(device)
    in_units = tuple(what + "." for what, _, _ in units)
    rest = {k: v for k, v in tensors.items() if not k.startswith(in_units)}
    vision = model.vision_model
    stacks = [(model.language_model, "layers"), (vision.transformer, "layers"),
              (vision.global_transformer, "layers")]
    loaded = [getattr(m, name) for m, name in stacks]
    for m, name in stacks:  # set aside: the rest is everything else
        setattr(m, name, nn.ModuleList())
    try:
        _fill(model, rest, dtype)
        shard_mllama_head(model, rank, comm)
        model.to(device)
    finally:
        for (m, name), layers in zip(stacks, loaded, strict=True):
            setattr(m, name, layers)
    rope = model.language_model.rotary_emb  # non-persistent buffer: recompute on the device
    rope.inv_freq = rope_inv_freq(cfg.text.rope, cfg.text.head_dim).to(device)
    return model.eval(), load_tokenizer(checkpoint)


# HF model_type -> loader(checkpoint, dtype, device, rank, comm) -> (model shard, tokenizer)
SHARD_LOADERS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {"mllama": load_mllama_shard}


def load_model_shard(checkpoint: Any, dtype: torch.dtype, device: torch.device, rank: int,
                     comm: Comm) -> tuple[nn.Module, Any]:
    model_type = checkpoint.config.get("model_type")
    if model_type not in SHARD_LOADERS:
        raise TensorParallelError(f"--tensor-parallel-size {comm.world}: model_type "
                                  f"{model_type!r} has no tensor-parallel plan (supported: "
                                  f"{sorted(SHARD_LOADERS)})")
    return SHARD_LOADERS[model_type](checkpoint, dtype, device, rank, comm)
