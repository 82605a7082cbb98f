"""Next-token choice for a whole batch: logits filters, then greedy or temperature/top-p.

:func:`plan_sampling` runs on the host once per batch composition and turns the requests'
settings into device tensors (filter groups, temperatures, top-p); :func:`sample` then works on
``[B, V]`` logits with tensor ops only and never waits for the device. Sampling uses the
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws from ``p`` exactly; each
seeded request has its own device generator, so its draws do not depend on its batch.

Log-probabilities are taken from the filtered logits before temperature scaling (as
openai-whisper does for its average log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.host_copy import to_device
from edserve.engine.logits_filter import FilterContext, LogitsFilter
from edserve.engine.req import Req
from edserve.engine.token_history import TokenHistory


@dataclass
class FilterGroup:
    filters: tuple[LogitsFilter, ...]  # applied in order
    rows: torch.Tensor | None  # [n] int64 batch rows of the group; None = the whole batch
    rids: tuple[str, ...]


@dataclass
class SamplingPlan:
    """Per-batch sampling state (built once per batch composition, reused across steps)."""

    groups: list[FilterGroup]
    sampled: torch.Tensor | None  # [S] int64 batch rows with temperature > 0; None = all greedy
    temperature: torch.Tensor | None  # [S] float32
    top_p: torch.Tensor | None  # [S] float32
    generators: list[torch.Generator | None]  # [S] per sampled row (None: the default one)


def plan_sampling(reqs: list[Req], device: torch.device) -> SamplingPlan:
    by_chain: dict[tuple[LogitsFilter, ...], list[int]] = {}
    sampled: list[int] = []
    for i, r in enumerate(reqs):
        chain = tuple(r.request.logits_processors)
        if chain:
            by_chain.setdefault(chain, []).append(i)
        if r.request.sampling.temperature > 0:
            sampled.append(i)
    groups = [FilterGroup(chain, None if len(rows) == len(reqs) else
                          to_device(rows, torch.int64, device), tuple(reqs[i].rid for i in rows))
              for chain, rows in by_chain.items()]
    if not sampled:
        return SamplingPlan(groups, None, None, None, [])
    sps = [reqs[i].request.sampling for i in sampled]
    return SamplingPlan(groups, to_device(sampled, torch.int64, device),
                        to_device([s.temperature for s in sps], torch.float32, device),
                        to_device([s.top_p for s in sps], torch.float32, device),
                        [reqs[i].generator for i in sampled])


def sample(logits: torch.Tensor, plan: SamplingPlan, history: TokenHistory,
           rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V]; rows: [B] int64 ``req_to_token`` rows. Appends the chosen tokens to
    ``history`` and returns (tokens [B] int64, their log-probabilities [B] float32), on the
    device."""
    logits = logits.float()
    greedy = None  # [B] rows a filter made greedy at this step (only when some rows sample)
    if plan.sampled is not None and plan.groups:
        greedy = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if plan.groups:
        hist, lens = history.view(rows)  # [B, C], [B]
        for g in plan.groups:
            if g.rows is None:
                _apply(g.filters, logits, FilterContext(hist, lens, g.rids, greedy))
            else:
                sub = logits.index_select(0, g.rows)
                sub_greedy = None if greedy is None else greedy.index_select(0, g.rows)
                ctx = FilterContext(hist.index_select(0, g.rows), lens.index_select(0, g.rows),
                                    g.rids, sub_greedy)
                _apply(g.filters, sub, ctx)
                logits.index_copy_(0, g.rows, sub)
                if greedy is not None:
                    greedy.index_copy_(0, g.rows, sub_greedy)
    tokens = torch.argmax(logits, dim=-1)  # [B] greedy unless a request samples
    if plan.sampled is not None:
        drawn = _draw(logits.index_select(0, plan.sampled), plan)
        if greedy is not None:
            drawn = torch.where(greedy.index_select(0, plan.sampled),
                                tokens.index_select(0, plan.sampled), drawn)
        tokens.index_copy_(0, plan.sampled, drawn)
    # log p(token) = logit - logsumexp(logits): no [B, V] log-softmax is materialised.
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    history.append(rows, tokens)
    return tokens, logprobs


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A request's own random stream on ``device`` (None: the device's default stream)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _apply(filters: tuple[LogitsFilter, ...], logits: torch.Tensor, ctx: FilterContext) -> None:
    for f in filters:
        f.apply(logits, ctx)


def _draw(logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    """[S, V] filtered logits -> [S] tokens drawn at each row's temperature and top-p."""
    probs = torch.softmax(logits / plan.temperature[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [S, V]
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < plan.top_p[:, None]  # nucleus
    sorted_p = sorted_p.masked_fill(~keep, 0.0)
    noise = torch.empty_like(sorted_p)
    for i, gen in enumerate(plan.generators):  # per-row streams: batch-independent draws
        noise[i].exponential_(generator=gen)
    choice = torch.argmax(sorted_p / noise, dim=-1, keepdim=True)  # [S, 1]
    return order.gather(1, choice)[:, 0]
