"""``SamplingParams.top_logprobs``: plain rows asking for their top-k alternatives share the
sampler's candidate outputs with row groups (beam search reads the first top-k rows, best_of
its draws). A batch mixing them gives every request what it gets alone, on the host beam path
and the device one; the alternatives are the row's best tokens (greedy: the chosen one first,
with its own log-probability); bad values are refused."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine


def _request(i: int, **sampling) -> GenerateRequest:
    g = torch.Generator().manual_seed(i)
    return GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                           SamplingParams(max_new_tokens=6, ignore_eos=True, **sampling),
                           rid=f"r{i}")


KINDS = [dict(top_logprobs=4), dict(beam_size=3), dict(top_logprobs=2),
         dict(temperature=0.7, best_of=2, seed=3), dict(), dict(temperature=0.9, seed=5,
                                                                top_logprobs=3)]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-beams", "device-beams"])
def test_top_logprobs_beside_row_groups(random_whisper, on_device):
    engine = build_engine(model=str(random_whisper), max_running_requests=16,
                          beam_on_device=on_device, overlap_schedule="on")
    together = engine.generate([_request(i, **kw) for i, kw in enumerate(KINDS)])
    engine.check_integrity()
    for i, kw in enumerate(KINDS):
        (alone,) = engine.generate([_request(i, **kw)])
        out = together[i]
        assert out.token_ids == alone.token_ids, kw
        assert _same(out.top_logprobs, alone.top_logprobs), kw
        k = kw.get("top_logprobs", 0)
        assert len(out.top_logprobs) == (len(out.token_ids) if k else 0)
        for t, alternatives in enumerate(out.top_logprobs):
            assert len(alternatives) == k and len({a for a, _ in alternatives}) == k
            lps = [lp for _, lp in alternatives]
            assert lps == sorted(lps, reverse=True) and lps[0] <= 0
            chosen = dict(alternatives).get(out.token_ids[t])
            if kw.get("temperature", 0) == 0:  # greedy: the chosen token is the best
                assert alternatives[0][0] == out.token_ids[t]
            if chosen is not None:
                assert chosen == pytest.approx(out.logprobs[t], abs=1e-5)
            else:
                assert out.logprobs[t] <= lps[-1] + 1e-5  # a draw outside the top k
    engine.check_integrity()


def _same(a: list, b: list) -> bool:
    return [[t for t, _ in x] for x in a] == [[t for t, _ in x] for x in b] and all(
        lp == pytest.approx(lq, abs=1e-5)
        for x, y in zip(a, b, strict=True) for (_, lp), (_, lq) in zip(x, y, strict=True))


@pytest.mark.parametrize("kw,needle", [
    (dict(top_logprobs=21), "top_logprobs must be in 0..20"),
    (dict(top_logprobs=-1), "top_logprobs must be in 0..20"),
    (dict(top_logprobs=2.0), "top_logprobs must be an integer"),
    (dict(top_logprobs=2, beam_size=2), "top_logprobs needs plain decoding"),
    (dict(top_logprobs=2, best_of=2, temperature=1.0), "top_logprobs needs plain decoding"),
])
def test_bad_top_logprobs_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)
