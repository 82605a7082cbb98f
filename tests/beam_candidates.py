"""Random beam-step candidates for the device beam-choice tests (tests/engine/test_beam_device.py,
tests/kernels/test_beam_choice.py)."""

from __future__ import annotations

import torch


def candidates(gen: torch.Generator, G: int, B: int, T: int, vocab: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, B, T] distinct tokens per slot and log-probs best first: quarter steps (ties within
    and across beams) or continuous, a few trailing ``-inf`` (a filter left fewer choices),
    a few slots offering only token 0 (a stop token: nothing may be kept)."""
    toks = torch.stack([torch.randperm(vocab, generator=gen)[:T] for _ in range(G * B)])
    only_stop = torch.rand(G * B, 1, generator=gen) < 0.2
    toks[:, :1] = torch.where(only_stop, 0, toks[:, :1])
    toks[:, 1:] = torch.where(only_stop & (toks[:, 1:] == 0), vocab - 1, toks[:, 1:])
    steps = -0.25 * torch.randint(0, 12, (G * B, T), generator=gen).float()
    smooth = -3 * torch.rand(G * B, T, generator=gen)
    quant = torch.rand(G * B, 1, generator=gen) < 0.6
    lps = torch.where(quant, steps, smooth).sort(dim=1, descending=True).values
    cut = torch.randint(1, T + 1, (G * B, 1), generator=gen)
    cut = torch.where(torch.rand(G * B, 1, generator=gen) < 0.15, cut, T)
    cut = torch.where(only_stop, 1, cut)
    lps = lps.masked_fill(torch.arange(T)[None, :] >= cut, float("-inf"))
    return toks.reshape(G, B, T), lps.reshape(G, B, T)
