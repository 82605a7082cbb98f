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
    sampled = []
    for i, req in enumerate(reqs):
        request = req.request
        for proc in request.logits_processors:
            proc(req.output_ids, logits[i])
        if request.sampling.temperature > 0:
            sampled.append(i)
    tokens = torch.argmax(logits, dim=-1)  # [B] greedy unless a request samples
    for i in sampled:
        sp = reqs[i].request.sampling
        tokens[i] = _sample_one(logits[i], sp.temperature, sp.top_p, reqs[i].generator)
    # log p(token) = logit - logsumexp(logits): no [B, V] log-softmax is materialised.
    chosen = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    out = torch.stack([tokens.double(), chosen.double()]).tolist()  # the step's one sync
    return [int(t) for t in out[0]], out[1]


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
