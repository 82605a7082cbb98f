"""HF transformers parity: same weights -> same encoder output, close logits, identical greedy
tokens, at every page size x encoder-KV strategy (small random-weight Whisper)."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import hf_greedy

from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

STEPS = 12
PROMPT = [50257, 50362]  # <|startoftranscript|><|notimestamps|>


@pytest.fixture(scope="module")
def hf_model(random_whisper):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(random_whisper).eval()


@pytest.fixture(scope="module")
def mels():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(3)]


@pytest.fixture(scope="module")
def hf_reference(hf_model, mels):
    return [hf_greedy(hf_model, m, PROMPT, STEPS) for m in mels]


def test_encoder_output_matches_hf(random_whisper, hf_model, mels):
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2)
    with torch.no_grad():
        ours = engine.model.encode(mels[:2])
        ref = hf_model.model.encoder(torch.stack(mels[:2])).last_hidden_state
    for o, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["aligned", "ragged", "flat"])
@pytest.mark.parametrize("page_size", ["1", "16", "64", "128"])
def test_greedy_tokens_and_logits_match_hf(random_whisper, mels, hf_reference, strategy,
                                           page_size):
    engine = build_engine(model=str(random_whisper), device="cpu", page_size=page_size,
                    encoder_kv=strategy, max_running_requests=4)
    recorders = [LogitsRecorder() for _ in mels]
    reqs = [GenerateRequest(PROMPT, m, SamplingParams(max_new_tokens=STEPS, ignore_eos=True),
                            logits_processors=[rec]) for m, rec in zip(mels, recorders,
                                                                        strict=True)]
    outs = engine.generate(reqs)
    for out, rec, (ref_tokens, ref_logits) in zip(outs, recorders, hf_reference, strict=True):
        assert out.error is None
        assert out.token_ids == ref_tokens
        assert len(rec.rows) == len(ref_logits)
        for ours, ref in zip(rec.rows, ref_logits, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)
    engine.check_integrity()
    assert engine.pools.allocator.available_size() == engine.pools.allocator.size
