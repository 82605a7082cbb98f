"""The tensor-parallel transform on one process: the tiny Mllama in float64, split 2 ways, its
two shards run as two threads whose collectives meet in memory (a fake 2-rank split; the real
gloo group is tested in ``test_tp_engine.py``). Sharded == unsharded: vision encoder, the text
decoder through the paged KV cache (prefill + decode, every strategy), and the logits."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from edserve.models.registry import build_model
from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration
from edserve.multimodal.mllama_image import MllamaImageConfig, preprocess_images
from edserve.parallel import TensorParallelError, apply_tensor_parallel
from edserve.parallel.tp import kv_heads_per_rank
from tests.models.mllama.harness import greedy, make_pools
from tests.parallel.tiny_mllama import tiny_cases, tiny_checkpoint

CPU = torch.device("cpu")


class ThreadComm:
    """Collectives between the threads of one split (rank order sums: equal on every rank)."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world, self.slots, self.barrier = rank, world, slots, barrier

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = t.clone()
        self.barrier.wait()
        parts = [s.clone() for s in self.slots]
        self.barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return t.copy_(total)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t)


@pytest.fixture(scope="module")
def models():
    ck = tiny_checkpoint()
    full = build_model(ck, torch.float64, CPU)[0]
    slots, barrier = [None, None], threading.Barrier(2, timeout=60)
    shards = [apply_tensor_parallel(build_model(ck, torch.float64, CPU)[0], r, 2,
                                    ThreadComm(r, 2, slots, barrier)) for r in range(2)]
    return full, shards


def _on_both(shards, fn):
    with ThreadPoolExecutor(2) as pool:
        return [f.result() for f in [pool.submit(fn, r, m) for r, m in enumerate(shards)]]


def _cases():
    cfg = MllamaImageConfig(image_size=56)
    return [(p, preprocess_images(imgs, cfg) if imgs else None) for p, imgs in tiny_cases()]


def test_shards_hold_half_of_each_split_layer(models):
    full, shards = models
    f_attn = full.language_model.layers[0].self_attn
    for r, m in enumerate(shards):
        attn = m.language_model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
        assert attn.qkv_proj.parts == (("q_proj", 32), ("k_proj", 16), ("v_proj", 16))
        # rank r's q rows are heads 2r, 2r+1 of the full projection; its k rows kv head r
        q, k, _ = attn.qkv_proj.split(attn.qkv_proj.weight.t())
        fq, fk, _ = f_attn.qkv_proj.split(f_attn.qkv_proj.weight.t())
        assert torch.equal(q, fq[:, 32 * r:32 * (r + 1)])
        assert torch.equal(k, fk[:, 16 * r:16 * (r + 1)])
        assert m.language_model.layers[0].mlp.down_proj.weight.shape == (64, 64)
        assert m.lm_head.weight.shape == (64, 64)
        assert m.vision_model.transformer.layers[0].self_attn.num_heads == 2
    assert kv_heads_per_rank(full, 2) == 1


def test_vision_encoder_matches_unsharded(models):
    full, shards = models
    inputs = [x for _, x in _cases() if x is not None]
    with torch.inference_mode():
        ref = full.encode(inputs)
        outs = _on_both(shards, lambda r, m: m.encode(inputs))
    for per_rank in outs:
        for a, b in zip(per_rank, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy,page_size", [("aligned", 16), ("flat", 1), ("ragged", 128)])
def test_decoder_matches_unsharded(models, strategy, page_size):
    full, shards = models
    cases = _cases()
    ref = greedy(full, make_pools(full, strategy, page_size, dtype=torch.float64), cases, 4)
    runs = _on_both(shards, lambda r, m: greedy(
        m, make_pools(m, strategy, page_size, dtype=torch.float64,
                      num_kv_heads=kv_heads_per_rank(m, 2)), cases, 4))
    for per_rank in runs:
        for a, b in zip(per_rank, ref, strict=True):
            assert a.tokens == b.tokens
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-10)
            torch.testing.assert_close(a.prefill_hidden, b.prefill_hidden, rtol=0, atol=1e-10)


def test_unsplittable_models_are_refused():
    ck = tiny_checkpoint()
    with pytest.raises(TensorParallelError, match="not divisible by --tensor-parallel-size 3"):
        apply_tensor_parallel(build_model(ck, torch.float32, CPU)[0], 0, 3,
                              ThreadComm(0, 3, [None] * 3, threading.Barrier(3)))
    whisper = WhisperForConditionalGeneration(WhisperConfig(
        d_model=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=8,
        decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=8, num_mel_bins=4,
        max_source_positions=4, max_target_positions=4, vocab_size=8))
    with pytest.raises(TensorParallelError, match="no tensor-parallel plan"):
        apply_tensor_parallel(whisper, 0, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_layerwise_load_equals_transform_of_the_loaded_model(models, rank):
    """The loader that never holds the unsplit model builds the same shard as splitting the
    whole loaded model (every parameter and head count, bit for bit)."""
    from edserve.parallel.comm import TorchComm
    from edserve.parallel.load import load_model_shard

    ck = tiny_checkpoint()
    comm = TorchComm(2)  # no collective runs while loading
    streamed, _ = load_model_shard(ck, torch.float64, CPU, rank, comm)
    whole = apply_tensor_parallel(build_model(ck, torch.float64, CPU)[0], rank, 2, comm)
    got, want = streamed.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert type(streamed.lm_head) is type(whole.lm_head)
    for a, b in zip(streamed.modules(), whole.modules(), strict=True):
        for attr in ("num_heads", "num_kv_heads"):
            assert getattr(a, attr, None) == getattr(b, attr, None)
    assert torch.equal(streamed.language_model.rotary_emb.inv_freq,
                       whole.language_model.rotary_emb.inv_freq)
