"""Drawing tokens (edserve.engine.draw.draw): the law of each draw, top-p, per-row streams."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.draw import draw

N = 20000  # draws per check: a frequency is within 4 sigma of its probability


def _freq(logits: torch.Tensor, temperature: float, top_p: float | None, seed: int = 0):
    """Frequencies of N draws from one row (N rows of the same logits, one stream each)."""
    rows = logits.expand(N, -1)
    temp = torch.full((N,), temperature)
    tp = None if top_p is None else torch.full((N,), top_p)
    gens = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    tokens = draw(rows, temp, tp, gens)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / N


def _close(freq: torch.Tensor, p: torch.Tensor) -> None:
    sigma = (p * (1 - p) / N).sqrt()
    assert bool(((freq - p).abs() <= 4 * sigma + 1e-12).all()), (freq, p)


def test_draws_follow_the_tempered_distribution_and_never_pick_masked_tokens():
    logits = torch.tensor([2.0, float("-inf"), 0.5, 1.0, float("-inf"), -1.0, 0.0, 3.0])
    for temperature in (1.0, 0.5):
        p = torch.softmax(logits.double() / temperature, -1)
        freq = _freq(logits, temperature, None)
        _close(freq, p)
        assert freq[1] == 0 and freq[4] == 0  # probability 0: never drawn


def test_top_p_keeps_the_smallest_prefix_of_sorted_mass():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05]))
    freq = _freq(logits, 1.0, 0.75)  # sorted 0.5, 0.3 (sum 0.8 >= 0.75): only those two
    _close(freq, torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0], dtype=torch.float64))
    freq = _freq(logits, 1.0, 1.0)  # top-p 1 through the sorting path: the whole law
    _close(freq, torch.softmax(logits.double(), -1))


def test_each_row_draws_from_its_own_stream():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    temp = torch.ones(3)

    def gens():
        return [torch.Generator().manual_seed(s) for s in (7, 8, 9)]
    both = draw(logits, temp, None, gens())
    assert torch.equal(both, draw(logits, temp, None, gens()))  # a seed repeats its draw
    alone = draw(logits[1:2], temp[:1], None, [torch.Generator().manual_seed(8)])
    assert int(alone[0]) == int(both[1])  # independent of the rows beside it
    cold = draw(logits, torch.full((3,), 1e-4), None, gens())
    assert torch.equal(cold, logits.argmax(-1))  # temperature -> 0: the argmax


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_follow_the_law_without_host_syncs():
    logits = torch.tensor([2.0, float("-inf"), 0.5, 1.0, 0.0, 3.0], device="cuda")
    rows = logits.expand(N, -1)
    gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(N)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = draw(rows, torch.full((N,), 0.8, device="cuda"), None, gens)
        nucleus = draw(rows[:64], torch.ones(64, device="cuda"),
                        torch.full((64,), 0.5, device="cuda"), gens[:64])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    freq = torch.bincount(tokens.cpu(), minlength=6).double() / N
    _close(freq, torch.softmax(logits.double().cpu() / 0.8, -1))
    assert set(nucleus.tolist()) <= {0, 5}  # top-p 0.5: the two likeliest tokens only
