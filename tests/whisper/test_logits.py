"""openai-whisper's logit filters, batched, on synthetic logits; and equality with the
per-request reference filters (``reference_filters.py``) on random batches."""

from __future__ import annotations

import math

import pytest
import torch

from edserve.engine.logits_filter import FilterContext
from edserve.whisper import logits as batched
from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)

from . import reference_filters as ref

V = 51864
C = 64  # history columns


def _ctx(histories: list[list[int]]) -> FilterContext:
    hist = torch.zeros(len(histories), C, dtype=torch.int64)
    for i, h in enumerate(histories):
        hist[i, :len(h)] = torch.tensor(h, dtype=torch.int64)
    lens = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    return FilterContext(hist, lens, tuple(f"r{i}" for i in range(len(histories))))


def _apply(f, history: list[int], x: torch.Tensor) -> torch.Tensor:
    row = x[None].clone()
    f.apply(row, _ctx([history]))
    return row[0]


def test_suppress_blank_only_first_position(tok):
    proc = SuppressBlank.of(tok)
    x = _apply(proc, [], torch.zeros(V))
    assert x[tok.eot] == -math.inf and x[tok.encode(" ")[0]] == -math.inf
    assert torch.isfinite(_apply(proc, [400], torch.zeros(V))).all()


def test_suppress_tokens(tok):
    ids = default_suppress_tokens(tok)
    assert tok.sot in ids and tok.no_speech in ids and tok.sot_prev in ids
    assert tok.eot not in ids and tok.timestamp_begin not in ids
    x = _apply(SuppressTokens.of(ids), [1, 2], torch.zeros(V))
    assert (x[ids] == -math.inf).all() and int(torch.isinf(x).sum()) == len(set(ids))


def test_equal_settings_compare_equal(tok):
    """Requests with the same settings share one filter group in the sampler."""
    assert ApplyTimestampRules.of(tok) == ApplyTimestampRules.of(tok)
    assert hash(SuppressBlank.of(tok)) == hash(SuppressBlank.of(tok))
    assert ApplyTimestampRules.of(tok, 1.0) != ApplyTimestampRules.of(tok, 2.0)


def test_first_token_is_early_timestamp(tok):
    tb = tok.timestamp_begin
    x = _apply(ApplyTimestampRules.of(tok, max_initial_timestamp=1.0), [], torch.zeros(V))
    allowed = torch.isfinite(x).nonzero().flatten().tolist()
    assert allowed == list(range(tb, tb + 51))  # <|0.00|> .. <|1.00|>


def test_timestamps_pair_and_never_decrease(tok):
    tb = tok.timestamp_begin
    rules = ApplyTimestampRules.of(tok)
    x = torch.zeros(V)  # after "<|0.00|> text <|2.00|>": close the pair or end; nothing < 2.00
    x[tok.eot] = 20.0  # so the "timestamp mass wins" rule does not hide end-of-text
    x = _apply(rules, [tb, 100, tb + 100], x)
    assert torch.isinf(x[:tok.eot]).all() and torch.isinf(x[tb:tb + 100]).all()
    assert torch.isfinite(x[tb + 100]) and torch.isfinite(x[tok.eot])
    y = _apply(rules, [tb, 100, tb + 100, tb + 100], torch.zeros(V))  # a closed pair: text next
    assert torch.isinf(y[tb:]).all() and torch.isfinite(y[:tok.eot]).all()
    z = _apply(rules, [tb + 10, 100], torch.zeros(V))  # mid-text: later timestamps only
    assert torch.isinf(z[tb:tb + 11]).all() and torch.isfinite(z[tb + 11])


def test_forces_timestamp_when_their_mass_wins(tok):
    tb = tok.timestamp_begin
    x = torch.full((V,), -10.0)
    x[100] = 0.0  # best text token
    x[tb + 5: tb + 400] = -1.0  # many likely timestamps: their total beats token 100
    x = _apply(ApplyTimestampRules.of(tok), [tb, 100, 200], x)
    assert torch.isinf(x[:tb]).all()
    assert tok.no_timestamps < tb and x[tok.no_timestamps] == -math.inf


def _random_history(gen: torch.Generator, tb: int, eot: int) -> list[int]:
    """A history shaped like real decoding: text tokens and non-decreasing timestamps."""
    n = int(torch.randint(0, 12, (1,), generator=gen))
    out, ts = [], tb
    for _ in range(n):
        if float(torch.rand(1, generator=gen)) < 0.4:
            ts += int(torch.randint(0, 40, (1,), generator=gen))
            out.append(min(ts, tb + 1500))
        else:
            out.append(int(torch.randint(0, eot, (1,), generator=gen)))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_batched_filters_equal_per_request_reference(tok, seed):
    """The batched chain on [B, V] == the reference filters run row by row, including the
    timestamp-mass rule (logits scaled so it fires on some rows and not on others)."""
    gen = torch.Generator().manual_seed(seed)
    tb, B = tok.timestamp_begin, 16
    ids = default_suppress_tokens(tok)
    chain_new = [SuppressBlank.of(tok), SuppressTokens.of(ids), ApplyTimestampRules.of(tok)]
    chain_ref = [ref.SuppressBlank(tok), ref.SuppressTokens(ids), ref.ApplyTimestampRules(tok)]
    histories = [_random_history(gen, tb, tok.eot) for _ in range(B)]
    logits = torch.randn(B, V, generator=gen) * 3
    logits[:, tb:] += torch.randn(B, 1, generator=gen) * 4  # timestamp mass varies per row
    expected = logits.clone()
    for i, h in enumerate(histories):
        for f in chain_ref:
            f(h, expected[i])
    ours = logits.clone()
    ctx = _ctx(histories)
    for f in chain_new:
        f.apply(ours, ctx)
    forced = torch.isinf(expected[:, :tb]).all(dim=1)
    assert 0 < int(forced.sum()) < B or seed % 2  # the mass rule is exercised both ways
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_module_exports_only_batched_filters():
    assert all(issubclass(c, batched.LogitsFilter) for c in
               (SuppressBlank, SuppressTokens, ApplyTimestampRules))
