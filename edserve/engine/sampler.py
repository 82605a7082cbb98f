"""Next-token choice: logits processors, then greedy or temperature/top-p sampling.

Log-probabilities are taken from the processed logits before temperature scaling (as
openai-whisper does for its average log-probability).
"""

from __future__ import annotations

import torch

from edserve.engine.req import Req


def sample(logits: torch.Tensor, reqs: list[Req]) -> tuple[list[int], list[float]]:
    """logits: [B, V] (one row per request) -> (token ids, their log-probabilities)."""
    logits = logits.float()
    for i, req in enumerate(reqs):
        for proc in req.request.logits_processors:
            proc(req.output_ids, logits[i])
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    tokens = torch.argmax(logits, dim=-1)  # [B] greedy unless a request samples
    for i, req in enumerate(reqs):
        sp = req.request.sampling
        if sp.temperature > 0:
            tokens[i] = _sample_one(logits[i], sp.temperature, sp.top_p, req.generator)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _sample_one(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        return order[choice[0]].to(logits.device)
    return torch.multinomial(probs, 1, generator=generator)[0].to(logits.device)
