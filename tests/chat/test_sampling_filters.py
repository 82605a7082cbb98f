"""The chat's logit_bias and frequency/presence penalty filters against a plain loop over each
row's generated tokens (padding past a row's length ignored), and their value semantics."""

from __future__ import annotations

import torch

from edserve.chat.sampling_filters import LogitBias, RepetitionPenalties, chat_filters
from edserve.engine.logits_filter import FilterContext


def _ctx(rows: list[list[int]], width: int = 6) -> FilterContext:
    history = torch.full((len(rows), width), 7, dtype=torch.int64)  # 7: stale padding
    for i, r in enumerate(rows):
        history[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows])
    return FilterContext(history, lengths, tuple(f"r{i}" for i in range(len(rows))))


def test_penalties_match_a_loop_over_generated_tokens():
    rows = [[], [3, 3, 5], [1, 2, 3, 3, 3, 0]]
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    want = logits.double().clone()
    for i, r in enumerate(rows):
        for t in set(r):
            want[i, t] -= 0.5 * r.count(t) + 1.25
    got = logits.clone()
    RepetitionPenalties(0.5, 1.25).apply(got, _ctx(rows))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert torch.equal(got[0], logits[0])  # nothing generated yet: nothing penalised
    assert got[1, 7] == logits[1, 7]  # the stale padding token is not counted


def test_negative_penalties_encourage_repeats():
    logits = torch.zeros(1, 4)
    RepetitionPenalties(-1.0, -0.5).apply(logits, _ctx([[2, 2]], width=3))
    assert logits.tolist() == [[0.0, 0.0, 2.5, 0.0]]


def test_logit_bias_adds_to_its_tokens_only():
    logits = torch.randn(2, 8)
    got = logits.clone()
    LogitBias(((1, 100.0), (6, -3.5))).apply(got, _ctx([[], [4]]))
    want = logits.clone()
    want[:, 1] += 100.0
    want[:, 6] -= 3.5
    assert torch.equal(got, want)


def test_chat_filters_are_values_and_none_by_default():
    assert chat_filters() == [] and chat_filters({}, 0.0, 0) == []
    a = chat_filters({5: 1.0, 2: -1}, 0.5, 0.0)
    assert a == chat_filters({2: -1.0, 5: 1}, 0.5, 0.0)  # equal settings: one sampler group
    assert [type(f) for f in a] == [LogitBias, RepetitionPenalties]
    assert a[0].bias == ((2, -1.0), (5, 1.0)) and a[0].capturable and a[1].capturable
    assert chat_filters(None, 0.0, 0.3) == [RepetitionPenalties(0.0, 0.3)]
