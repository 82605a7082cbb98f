"""K/V written into the pool by the Triton row-copy kernel (CPU interpreter here: an encoder's
cross K/V and every decoder token's) give the same tokens and bit-identical logits as
``index_put`` writes, at every encoder-KV strategy and page size (1500 encoder tokens end
mid-page at 16, 64 and 128); the conftest checks the pool's integrity after each engine."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.kernels import kv_write
from edserve.runtime import build_engine

PROMPT = [50257, 50362]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@pytest.fixture(scope="module")
def mels():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(80, 3000, generator=gen) * 0.5).to(DEVICE) for _ in range(2)]


@pytest.mark.parametrize("strategy", ["aligned", "ragged", "flat"])
@pytest.mark.parametrize("page_size", ["1", "16", "64", "128"])
def test_kernel_writes_equal_index_put(random_whisper, mels, strategy, page_size, monkeypatch):
    calls = []
    kernel = kv_write.write_kv_rows
    monkeypatch.setattr(kv_write, "write_kv_rows",
                        lambda *a: calls.append(a[2].shape[0]) or kernel(*a))
    # torch attention ops at every page size; only the pool's write path changes below
    engine = build_engine(model=str(random_whisper), device=DEVICE, dtype="float32",
                          attention_backend="torch", page_size=page_size, encoder_kv=strategy,
                          max_running_requests=2, debug_checks=True)

    def run(write_kernel: bool):
        engine.pools.kv_pool.write_kernel = write_kernel
        recs = [LogitsRecorder() for _ in mels]
        outs = engine.generate([GenerateRequest(PROMPT, m, SamplingParams(
            max_new_tokens=3, ignore_eos=True), logits_processors=[r])
            for m, r in zip(mels, recs, strict=True)])
        assert all(o.error is None for o in outs)
        return [o.token_ids for o in outs], [torch.stack(r.rows) for r in recs]

    ref_tokens, ref_logits = run(False)
    assert not calls
    tokens, logits = run(True)
    layers = engine.model.num_kv_layers
    cross = [n for n in calls if n == 2 * 1500]  # one launch per layer: both clips' K/V
    own = [n for n in calls if n != 2 * 1500]  # the prompt's and each step's decoder K/V
    assert len(cross) == layers
    assert len(own) >= 2 * layers and all(n <= 2 * len(PROMPT) for n in own)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)
