"""A minimal prefill + greedy-decode loop over the real KV machinery (no scheduler).

Rows and slots come from the mem_cache pools through ``edserve.engine.batch_builder``; each
step builds a ForwardBatch for the chosen encoder-KV strategy and page size, runs
``MllamaModel.encode`` (prefill) and ``forward``, and picks the argmax token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.batch_builder import Pools, build_decode, build_prefill, release
from edserve.engine.req import Req
from edserve.engine.request import GenerateRequest
from edserve.layers.attention import create_backend
from edserve.layers.forward_batch import ForwardMode
from edserve.mem_cache import (
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from edserve.models.mllama import MllamaModel
from edserve.multimodal.mllama_image import MllamaImageInput


@dataclass
class Run:
    tokens: list[int]
    logits: torch.Tensor  # [steps, vocab] float32: logits each token was chosen from
    prefill_hidden: torch.Tensor  # [S, hidden] final-norm hidden states of the prompt


def make_pools(model: MllamaModel, strategy: str, page_size: int, rows: int = 8,
               slots: int = 4096, dtype: torch.dtype = torch.float32,
               num_kv_heads: int | None = None) -> Pools:
    """``num_kv_heads``: heads per slot (default: the model's; a tensor-parallel shard holds
    fewer)."""
    backend = create_backend(strategy, page_size, "torch")
    slots = -(-slots // page_size) * page_size
    cols = -(-(backend.encoder_region(model.max_encoder_len) + 256) // page_size) * page_size
    alloc = TokenToKVPoolAllocator(slots) if page_size == 1 else \
        PagedTokenToKVPoolAllocator(slots, page_size)
    kv = KVPool(slots, page_size, model.num_kv_layers, num_kv_heads or model.num_kv_heads,
                model.head_dim, dtype)
    return Pools(ReqToTokenPool(rows, cols), alloc, kv, backend, torch.device("cpu"))


def make_req(model: MllamaModel, pools: Pools, prompt: list[int],
             image: MllamaImageInput | None, steps: int) -> Req:
    layout = model.cross_attention_layout(prompt, image)
    ranges = [tuple(r) for r in layout.ranges.tolist()] if image is not None else None
    request = GenerateRequest(prompt_ids=list(prompt), encoder_input=image,
                              cross_kv_ranges=ranges)
    enc_len = model.encoder_len(image)
    region = pools.backend.encoder_region(enc_len)
    ps = pools.kv_pool.page_size
    reserved = -(-(region + len(prompt) + steps) // ps) * ps
    return Req(request, enc_len, region, steps, reserved, encoder_input=image)


def _prepare(batch) -> None:
    """Build the backend's per-batch metadata (the runner's job) if the builder did not."""
    if batch.attn_metadata is None:
        batch.attn_backend.init_forward_metadata(batch)


@torch.inference_mode()
def greedy(model: MllamaModel, pools: Pools,
           cases: list[tuple[list[int], MllamaImageInput | None]], steps: int = 10) -> list[Run]:
    """Run all ``cases`` as one continuous batch; return each one's greedy tokens/logits."""
    reqs = [make_req(model, pools, p, img, steps) for p, img in cases]
    batch = build_prefill(pools, reqs)
    assert batch is not None and batch.mode == ForwardMode.EXTEND
    _prepare(batch)
    with_enc = [r for r in reqs if r.encoder_len > 0]
    enc = torch.cat(model.encode([r.encoder_input for r in with_enc])) if with_enc else None
    ids = torch.tensor([t for r in reqs for t in r.prompt_ids])
    hidden = model(ids, batch.positions, batch, enc)
    cu = batch.cu_q.tolist()
    runs = [Run([], torch.empty(0), hidden[cu[i]:cu[i + 1]].clone()) for i in range(len(reqs))]
    logits = [[] for _ in reqs]
    last = hidden[batch.cu_q[1:].long() - 1]
    for step in range(steps):
        lg = model.compute_logits(last)  # [B, vocab]
        for i, r in enumerate(reqs):
            tok = int(lg[i].argmax())
            r.output_ids.append(tok)
            logits[i].append(lg[i])
        if step == steps - 1:
            break
        batch = build_decode(pools, reqs)
        assert batch is not None
        _prepare(batch)
        ids = torch.tensor([r.output_ids[-1] for r in reqs])
        last = model(ids, batch.positions, batch, None)
    for i, r in enumerate(reqs):
        runs[i].tokens = list(r.output_ids)
        runs[i].logits = torch.stack(logits[i])
    release(pools, reqs)
    pools.req_to_token_pool.check_integrity(0)
    pools.allocator.check_integrity(torch.empty(0, dtype=torch.int64))
    return runs
