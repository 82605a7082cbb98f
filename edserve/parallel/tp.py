"""The tensor-parallel transform: split a loaded model's layers across ``world`` ranks, in place.

The model files stay free of parallelism (as in gpt-fast's ``tp.py``): a model is built and
loaded whole, then :func:`apply_tensor_parallel` keeps rank ``r``'s share of every projection:

* attention: q/k/v (fused or not) column-parallel by heads, so rank ``r`` holds q heads
  ``[r Hq/N, (r+1) Hq/N)`` and kv heads ``[r Hkv/N, (r+1) Hkv/N)`` (GQA groups stay on one
  rank); the head counts on the attention modules (and their KV-pool sites) are divided by N;
  the output projection is row-parallel (one all-reduce per layer).
* MLP: gate/up (fused) or fc1 column-parallel, down/fc2 row-parallel (one all-reduce).
* what is not split (embeddings, norms, gates, patch embedding, projector) is replicated; the
  LM head is vocab-parallel with an all-gather when the vocabulary divides by N, else
  replicated.

After the transform each rank's KV pool holds ``num_kv_heads / N`` heads per slot
(:func:`kv_heads_per_rank`). Sharders are registered per model class (a registry, not an
``if`` chain); Whisper is not registered yet.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from edserve.parallel.comm import Comm, TorchComm
from edserve.parallel.errors import TensorParallelError
from edserve.parallel.layers import RowParallelLinear, VocabParallelHead, shard_columns


def _heads(module: nn.Module, world: int, what: str, *names: str) -> None:
    """Divide the head-count attributes ``names`` of ``module`` by ``world``."""
    for name in names:
        n = getattr(module, name)
        if n % world:
            raise TensorParallelError(f"{what}.{name} ({n}) is not divisible by "
                                      f"--tensor-parallel-size {world}")
        setattr(module, name, n // world)


def _attention(attn: nn.Module, cols: list[str], row: str, rank: int, comm: Comm, what: str,
               heads: tuple[str, ...], site: str | None) -> None:
    world = comm.world
    _heads(attn, world, what, *heads)
    if site is not None:
        _heads(getattr(attn, site), world, f"{what}.{site}", "num_heads", "num_kv_heads")
    for name in cols:
        shard_columns(getattr(attn, name), rank, world, f"{what}.{name}")
    setattr(attn, row, RowParallelLinear(getattr(attn, row), rank, comm, f"{what}.{row}"))


def _mlp(mlp: nn.Module, col: str, row: str, rank: int, comm: Comm, what: str) -> None:
    shard_columns(getattr(mlp, col), rank, comm.world, f"{what}.{col}")
    setattr(mlp, row, RowParallelLinear(getattr(mlp, row), rank, comm, f"{what}.{row}"))


def shard_text_layer(layer: nn.Module, rank: int, comm: Comm, what: str) -> None:
    """A Mllama text decoder layer (self- or cross-attention, then the MLP)."""
    if hasattr(layer, "self_attn"):
        _attention(layer.self_attn, ["qkv_proj"], "o_proj", rank, comm, f"{what}.self_attn",
                   ("num_heads", "num_kv_heads"), "attn")
    else:
        _attention(layer.cross_attn, ["q_proj", "kv_proj"], "o_proj", rank, comm,
                   f"{what}.cross_attn", ("num_heads", "num_kv_heads"), "attn")
    _mlp(layer.mlp, "gate_up_proj", "down_proj", rank, comm, f"{what}.mlp")


def shard_vision_layer(layer: nn.Module, rank: int, comm: Comm, what: str) -> None:
    """A Mllama vision encoder layer (local or gated global)."""
    _attention(layer.self_attn, ["qkv_proj"], "o_proj", rank, comm, f"{what}.self_attn",
               ("num_heads",), None)
    _mlp(layer.mlp, "fc1", "fc2", rank, comm, f"{what}.mlp")


def shard_mllama_head(model: nn.Module, rank: int, comm: Comm) -> None:
    """The LM head: vocab-parallel when the vocabulary divides, else left replicated."""
    if model.lm_head.out_features % comm.world == 0:
        model.lm_head = VocabParallelHead(model.lm_head, rank, comm, "lm_head")


LayerSharder = Callable[[nn.Module, int, Comm, str], None]


def mllama_layer_units(model: nn.Module) -> list[tuple[str, nn.Module, LayerSharder]]:
    """(module path, layer, its sharder) for every split layer of a Mllama model; what they
    leave out (embeddings, norms, projector, head) is replicated, except the head."""
    vision = model.vision_model
    units = [(f"language_model.layers.{i}", layer, shard_text_layer)
             for i, layer in enumerate(model.language_model.layers)]
    for stack in ("transformer", "global_transformer"):
        units += [(f"vision_model.{stack}.layers.{i}", layer, shard_vision_layer)
                  for i, layer in enumerate(getattr(vision, stack).layers)]
    return units


def shard_mllama(model: nn.Module, rank: int, comm: Comm) -> None:
    """Mllama: text decoder (self and cross layers), vision encoder (local + global), head."""
    for what, layer, shard in mllama_layer_units(model):
        shard(layer, rank, comm, what)
    shard_mllama_head(model, rank, comm)


# model class name -> sharder(model, rank, comm), applied in place
SHARDERS: dict[str, Callable[[nn.Module, int, Comm], None]] = {
    "MllamaModel": shard_mllama,
}


def check_shardable(model: nn.Module, world: int) -> None:
    """Raise :class:`TensorParallelError` unless ``model`` can be split ``world`` ways."""
    name = type(model).__name__
    if name not in SHARDERS:
        raise TensorParallelError(f"--tensor-parallel-size {world}: {name} has no "
                                  f"tensor-parallel plan (supported: {sorted(SHARDERS)})")


def apply_tensor_parallel(model: nn.Module, rank: int, world: int,
                          comm: Comm | None = None) -> nn.Module:
    """Keep rank ``rank``'s shard of ``model`` (in place; returns it). ``comm``: how the
    ranks' layers talk (default: ``torch.distributed``'s default group)."""
    check_shardable(model, world)
    comm = comm or TorchComm(world)
    if comm.world != world:
        raise TensorParallelError(f"comm spans {comm.world} ranks, the split {world}")
    if world > 1:
        SHARDERS[type(model).__name__](model, rank, comm)
    return model


def kv_heads_per_rank(model: nn.Module, world: int) -> int:
    """KV heads per slot in each rank's KV pool (the model reports its unsplit count)."""
    n = model.num_kv_heads
    if n % world:
        raise TensorParallelError(f"num_kv_heads ({n}) is not divisible by "
                                  f"--tensor-parallel-size {world}")
    return n // world
