"""openai-whisper's logit filters on synthetic logits."""

from __future__ import annotations

import math

import torch

from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)

V = 51864


def _logits() -> torch.Tensor:
    return torch.zeros(V)


def test_suppress_blank_only_first_position(tok):
    proc = SuppressBlank(tok)
    x = _logits()
    proc([], x)
    assert x[tok.eot] == -math.inf and x[tok.encode(" ")[0]] == -math.inf
    y = _logits()
    proc([400], y)
    assert torch.isfinite(y).all()


def test_suppress_tokens(tok):
    ids = default_suppress_tokens(tok)
    assert tok.sot in ids and tok.no_speech in ids and tok.sot_prev in ids
    assert tok.eot not in ids and tok.timestamp_begin not in ids
    x = _logits()
    SuppressTokens(ids)([1, 2], x)
    assert (x[ids] == -math.inf).all() and int(torch.isinf(x).sum()) == len(set(ids))


def test_first_token_is_early_timestamp(tok):
    tb = tok.timestamp_begin
    x = _logits()
    ApplyTimestampRules(tok, max_initial_timestamp=1.0)([], x)
    allowed = torch.isfinite(x).nonzero().flatten().tolist()
    assert allowed == list(range(tb, tb + 51))  # <|0.00|> .. <|1.00|>


def test_timestamps_pair_and_never_decrease(tok):
    tb = tok.timestamp_begin
    rules = ApplyTimestampRules(tok)
    x = _logits()  # after "<|0.00|> text <|2.00|>": close the pair or end; nothing before 2.00
    x[tok.eot] = 20.0  # so the "timestamp mass wins" rule does not hide end-of-text
    rules([tb, 100, tb + 100], x)
    assert torch.isinf(x[:tok.eot]).all() and torch.isinf(x[tb:tb + 100]).all()
    assert torch.isfinite(x[tb + 100]) and torch.isfinite(x[tok.eot])
    y = _logits()  # after a closed pair: text must follow, not another timestamp
    rules([tb, 100, tb + 100, tb + 100], y)
    assert torch.isinf(y[tb:]).all() and torch.isfinite(y[:tok.eot]).all()
    z = _logits()  # mid-text: later timestamps only (non-zero segment length)
    rules([tb + 10, 100], z)
    assert torch.isinf(z[tb:tb + 11]).all() and torch.isfinite(z[tb + 11])


def test_forces_timestamp_when_their_mass_wins(tok):
    tb = tok.timestamp_begin
    x = torch.full((V,), -10.0)
    x[100] = 0.0  # best text token
    x[tb + 5: tb + 400] = -1.0  # many likely timestamps: their total beats token 100
    ApplyTimestampRules(tok)([tb, 100, 200], x)
    assert torch.isinf(x[:tb]).all()
    assert tok.no_timestamps < tb and x[tok.no_timestamps] == -math.inf
