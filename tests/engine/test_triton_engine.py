"""The engine through the Triton attention kernels (CPU interpreter in CI, real GPU elsewhere)
gives the same tokens and close logits as the torch reference ops."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TOL = 1e-3 if DEVICE == "cuda" else 1e-4


def _run(folder, ops, strategy, page_size, mels):
    engine = build_engine(model=str(folder), attention_backend=ops, encoder_kv=strategy,
                    page_size=page_size, max_running_requests=2, device=DEVICE,
                    dtype="float32")
    recs = [LogitsRecorder() for _ in mels]
    reqs = [GenerateRequest([50257, 50362], m, SamplingParams(max_new_tokens=4, ignore_eos=True),
                            logits_processors=[r]) for m, r in zip(mels, recs, strict=True)]
    return [o.token_ids for o in engine.generate(reqs)], recs


@pytest.mark.parametrize("strategy,page_size", [("aligned", "16"), ("flat", "1")])
def test_triton_kernels_match_torch_reference_end_to_end(random_whisper, strategy, page_size):
    gen = torch.Generator().manual_seed(7)
    mels = [(torch.randn(80, 3000, generator=gen) * 0.5).to(DEVICE) for _ in range(2)]
    ref_tokens, ref_recs = _run(random_whisper, "torch", strategy, page_size, mels)
    tokens, recs = _run(random_whisper, "triton", strategy, page_size, mels)
    assert tokens == ref_tokens
    for rec, ref in zip(recs, ref_recs, strict=True):
        for a, b in zip(rec.rows, ref.rows, strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
