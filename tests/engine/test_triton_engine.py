"""The engine through the Triton attention kernels (CPU interpreter in CI, real GPU elsewhere)
gives the same tokens and close logits as the torch reference ops, and its grouped
cross-attention (row groups read their encoder K/V once) the same beams as per-row reads."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import make_random_whisper

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.kernels import grouped_cross_attention as gca
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


@pytest.fixture(scope="module")
def e2e_whisper(tmp_path_factory):
    """The session's random Whisper shape (two layers, four heads) with 150 encoder tokens
    instead of 1500: several 64-key blocks that end mid-page, a tenth of the interpreter's
    work."""
    return make_random_whisper(tmp_path_factory.mktemp("e2e_whisper"), source_positions=150)


@pytest.mark.parametrize("strategy,page_size", [("aligned", "16"), ("flat", "1")])
def test_triton_kernels_match_torch_reference_end_to_end(e2e_whisper, strategy, page_size):
    gen = torch.Generator().manual_seed(7)
    mels = [(torch.randn(80, 300, generator=gen) * 0.5).to(DEVICE) for _ in range(2)]
    ref_tokens, ref_recs = _run(e2e_whisper, "torch", strategy, page_size, mels)
    tokens, recs = _run(e2e_whisper, "triton", strategy, page_size, mels)
    assert tokens == ref_tokens
    for rec, ref in zip(recs, ref_recs, strict=True):
        for a, b in zip(rec.rows, ref.rows, strict=True):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)



@pytest.fixture(scope="module")
def short_whisper(tmp_path_factory):
    """One layer, two heads, 56 encoder tokens (not a multiple of 16): quick to interpret."""
    return make_random_whisper(tmp_path_factory.mktemp("short_whisper"), d_model=32, layers=1,
                               heads=2, source_positions=56)


@pytest.mark.parametrize("strategy,page_size", [("aligned", "16"), ("flat", "16")])
def test_grouped_cross_attention_matches_per_row_reads(short_whisper, strategy, page_size,
                                                       monkeypatch):
    """Beams, a best_of group and a greedy row: the grouped kernel (each group's encoder K/V
    read once) gives the tokens and log-probabilities of the per-row reads."""
    calls = []
    kernel = gca.grouped_cross_attention
    monkeypatch.setattr(gca, "grouped_cross_attention",
                        lambda *a, **kw: calls.append(a[3].shape) or kernel(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    mels = [(torch.randn(80, 112, generator=gen) * 0.5).to(DEVICE) for _ in range(2)]

    def run(grouped: bool):
        engine = build_engine(model=str(short_whisper), attention_backend="triton",
                        encoder_kv=strategy, page_size=page_size, max_running_requests=8,
                        device=DEVICE, dtype="float32", grouped_cross_attention=grouped,
                        debug_checks=True)
        assert engine.pools.backend.grouped_cross is grouped
        reqs = [GenerateRequest([50257, 50362], mels[0], SamplingParams(
                    beam_size=3, max_new_tokens=5)),
                GenerateRequest([50257, 50362], mels[1], SamplingParams(max_new_tokens=5)),
                GenerateRequest([50257, 50362], mels[1], SamplingParams(
                    temperature=0.8, best_of=2, seed=5, max_new_tokens=5))]
        outs = engine.generate(reqs)
        assert all(o.error is None for o in outs)
        engine.check_integrity()
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    tokens, logprobs = run(True)
    assert calls and all(shape[1] == MAX_GROUP_ROWS for shape in calls)
    calls.clear()
    ref_tokens, ref_logprobs = run(False)
    assert not calls
    assert tokens == ref_tokens
    for a, b in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=TOL, atol=TOL)
