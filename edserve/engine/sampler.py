"""Next-token choice for a whole batch: logits filters, then greedy or temperature/top-p.

:func:`plan_sampling` runs on the host once per batch composition and turns the requests'
settings into device tensors (filter groups, temperatures, top-p); :func:`sample` then works on
``[B, V]`` logits with tensor ops only and never waits for the device. Rows at temperature > 0
draw with :func:`edserve.engine.draw.draw` (the exact law, each seeded request from its own
device generator, so its draws do not depend on its batch).

Log-probabilities are taken from the filtered logits before temperature scaling (as
openai-whisper does for its average log-probability).

Rows of a row group (beam search, best_of) may also ask for *candidates*
(:class:`~edserve.engine.row_group.Candidates`): their top-k tokens by log-probability, or
several independent draws; so do plain rows whose request sets ``top_logprobs`` (their top-k);
these come back flat, in the order of ``CandidatePlan.layout`` (:func:`row_candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edserve.engine.draw import any_nucleus, draw
from edserve.engine.host_copy import to_device
from edserve.engine.logits_filter import FilterContext, LogitsFilter
from edserve.engine.req import Req
from edserve.engine.token_history import TokenHistory


@dataclass
class FilterGroup:
    filters: tuple[LogitsFilter, ...]  # applied in order (the first row's list)
    rows: torch.Tensor | None  # [n] int64 batch rows of the group; None = the whole batch
    rids: tuple[str, ...]
    # every row's own list (differs from ``filters`` only in ``per_row`` instances)
    chains: tuple[tuple[LogitsFilter, ...], ...] = ()


@dataclass
class SamplingPlan:
    """Per-batch sampling state (built once per batch composition, reused across steps)."""

    groups: list[FilterGroup]
    sampled: torch.Tensor | None  # [S] int64 batch rows with temperature > 0; None = all greedy
    temperature: torch.Tensor | None  # [S] float32
    top_p: torch.Tensor | None  # [S] float32; None: every row keeps all mass (top-p 1)
    generators: list[torch.Generator | None]  # [S] per sampled row (None: the default one)
    candidates: CandidatePlan | None = None


@dataclass
class CandidatePlan:
    """Extra per-row outputs for row groups; returned flat as [C] tokens and log-probs."""

    layout: list[tuple[int, int, int]]  # host: (batch row, offset in the flat output, count)
    topk_rows: torch.Tensor | None  # [G] int64 batch rows that want their top-k
    topk: int  # k for every topk row (the largest asked; rows read their first k')
    draw_rows: torch.Tensor | None  # [D] int64 batch row of each draw
    draw_temperature: torch.Tensor | None  # [D] float32
    draw_top_p: torch.Tensor | None  # [D] float32; None: all top-p 1 (or no draws)
    draw_generators: list[torch.Generator | None]  # [D]
    top_rows: frozenset[int] = frozenset()  # host: plain rows asking for top_logprobs


def plan_sampling(reqs: list[Req], device: torch.device,
                  first_step: bool | list[bool] = False) -> SamplingPlan:
    """``first_step``: whether the rows sample their first token (per row, or one value for
    all; a mixed step has both kinds)."""
    plan = _plan_tokens(reqs, device)
    if any(r.group is not None or r.request.sampling.top_logprobs for r in reqs):
        first = first_step if isinstance(first_step, list) else [first_step] * len(reqs)
        plan.candidates = _plan_candidates(reqs, device, first)
    return plan


def _plan_candidates(reqs: list[Req], device: torch.device, first_step: list[bool]
                     ) -> CandidatePlan | None:
    """Row groups' top-k rows first (device beams read the first ``R * k`` candidates), then
    the rows asking for ``top_logprobs``, then the draws."""
    asks = [(i, r, r.group.candidates(r, first_step[i])) for i, r in enumerate(reqs)
            if r.group is not None]
    topk = [(i, c.topk) for i, r, c in asks if c.topk]
    tops = [(i, r.request.sampling.top_logprobs) for i, r in enumerate(reqs)
            if r.group is None and r.request.sampling.top_logprobs]
    topk += tops
    draws = [(i, r, c.draws) for i, r, c in asks if c.draws]
    if not topk and not draws:
        return None
    k = max((n for _, n in topk), default=0)
    layout = [(i, j * k, n) for j, (i, n) in enumerate(topk)]
    offset = len(topk) * k
    draw_rows, temps, top_ps, gens = [], [], [], []
    for i, r, n in draws:
        layout.append((i, offset, n))
        offset += n
        sp = r.request.sampling
        draw_rows += [i] * n
        temps += [sp.temperature] * n
        top_ps += [sp.top_p] * n
        gens += list(r.group.generators[:n])
    up = (lambda v, dt: to_device(v, dt, device) if v else None)
    return CandidatePlan(layout, up([i for i, _ in topk], torch.int64), k,
                         up(draw_rows, torch.int64), up(temps, torch.float32),
                         up(top_ps, torch.float32) if any_nucleus(top_ps) else None, gens,
                         frozenset(i for i, _ in tops))


def _plan_tokens(reqs: list[Req], device: torch.device) -> SamplingPlan:
    by_chain: dict[tuple[Any, ...], list[int]] = {}  # per_row filters keyed by their class
    sampled: list[int] = []
    for i, r in enumerate(reqs):
        chain = r.request.logits_processors
        if chain:
            key = tuple(type(f) if f.per_row else f for f in chain)
            by_chain.setdefault(key, []).append(i)
        if r.request.sampling.temperature > 0:
            sampled.append(i)
    groups = []
    for rows in by_chain.values():
        chains = tuple(tuple(reqs[i].request.logits_processors) for i in rows)
        groups.append(FilterGroup(chains[0], None if len(rows) == len(reqs) else
                                  to_device(rows, torch.int64, device),
                                  tuple(reqs[i].rid for i in rows), chains))
    if not sampled:
        return SamplingPlan(groups, None, None, None, [])
    sps = [reqs[i].request.sampling for i in sampled]
    top_ps = [s.top_p for s in sps]
    return SamplingPlan(groups, to_device(sampled, torch.int64, device),
                        to_device([s.temperature for s in sps], torch.float32, device),
                        to_device(top_ps, torch.float32, device) if any_nucleus(top_ps) else None,
                        [reqs[i].generator for i in sampled])


def sample(logits: torch.Tensor, plan: SamplingPlan, history: TokenHistory,
           rows: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits: [B, V]; rows: [B] int64 ``req_to_token`` rows. Appends the chosen tokens to
    ``history`` and returns (tokens [B] int64, their log-probabilities [B] float32, the
    candidates ([C] int64 tokens, [C] float32 log-probs) or None), on the device."""
    logits = logits.float()
    greedy = None  # [B] rows a filter made greedy at this step (only when some rows sample)
    if (plan.sampled is not None or plan.candidates is not None) and plan.groups:
        greedy = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if plan.groups:
        hist, lens = history.view(rows)  # [B, C], [B]
        for g in plan.groups:
            if g.rows is None:
                _apply(g, logits, FilterContext(hist, lens, g.rids, greedy))
            else:
                sub = logits.index_select(0, g.rows)
                sub_greedy = None if greedy is None else greedy.index_select(0, g.rows)
                ctx = FilterContext(hist.index_select(0, g.rows), lens.index_select(0, g.rows),
                                    g.rids, sub_greedy)
                _apply(g, sub, ctx)
                logits.index_copy_(0, g.rows, sub)
                if greedy is not None:
                    greedy.index_copy_(0, g.rows, sub_greedy)
    fused = _fused_stats(logits, plan.candidates)  # CUDA: one read of the logits
    # [B] greedy unless a request samples
    tokens = torch.argmax(logits, dim=-1) if fused is None else fused[0]
    if plan.sampled is not None:
        drawn = draw(logits.index_select(0, plan.sampled), plan.temperature, plan.top_p,
                     plan.generators)
        if greedy is not None:
            drawn = torch.where(greedy.index_select(0, plan.sampled),
                                tokens.index_select(0, plan.sampled), drawn)
        tokens.index_copy_(0, plan.sampled, drawn)
    # log p(token) = logit - logsumexp(logits): no [B, V] log-softmax is materialised.
    lse = torch.logsumexp(logits, dim=-1) if fused is None else fused[1]  # [B]
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - lse
    history.append(rows, tokens)
    cands = None if plan.candidates is None \
        else _candidates(logits, lse, plan.candidates, tokens, greedy,
                         None if fused is None else fused[2])
    return tokens, logprobs, cands


def _fused_stats(logits: torch.Tensor, plan: CandidatePlan | None
                 ) -> tuple[torch.Tensor, torch.Tensor,
                            tuple[torch.Tensor, torch.Tensor] | None] | None:
    """On CUDA: (argmax [B], logsumexp [B], the top-k rows' (log-probs [G, k], ids [G, k]) or
    None without top-k rows) from one read of the logits (:mod:`edserve.kernels.logit_stats`);
    None: torch's ops instead (CPU)."""
    if not _on_triton(logits):
        return None
    from edserve.kernels import logit_stats  # here: CPU runs never import triton

    if plan is None or plan.topk_rows is None:  # greedy / sampled rows: argmax and lse only
        argmax, lse, _, _ = logit_stats.logit_stats(logits)
        return argmax, lse, None
    if plan.topk > logit_stats.MAX_K:
        return None
    # each batch row's place among the top-k rows (-1: none), from topk_rows on the device
    # (a sampling graph's static copy: rows move between replays)
    G, dev = plan.topk_rows.shape[0], logits.device
    slot = torch.full((logits.shape[0],), -1, dtype=torch.int32, device=dev)
    slot.index_copy_(0, plan.topk_rows, torch.arange(G, dtype=torch.int32, device=dev))
    argmax, lse, vals, ids = logit_stats.logit_stats(logits, slot, G, plan.topk)
    return argmax, lse, (vals, ids)


def _on_triton(logits: torch.Tensor) -> bool:
    """Whether the Triton logits kernels take ``logits`` (CUDA, contiguous rows)."""
    return logits.is_cuda and logits.stride(1) == 1


def _candidates(logits: torch.Tensor, lse: torch.Tensor, plan: CandidatePlan,
                tokens: torch.Tensor, greedy: torch.Tensor | None,
                topk: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ([C] tokens, [C] log-probs): top-k rows first (k each), then the draws. A row a
    filter made greedy (language detection) offers only its argmax: its other top-k entries
    get log-prob -inf, and its draws are the argmax. ``topk``: the top-k rows' log-probs and
    ids already taken (:func:`_fused_stats`)."""
    toks, lps = [], []
    if plan.topk_rows is not None:
        if topk is not None:
            vals, idx = topk
        else:
            # top-k of the logits, then minus the row's logsumexp: the same order and values
            # as the top-k of log-probs, without a [G, V] subtraction
            vals, idx = _topk_rows(logits, plan.topk_rows, plan.topk)
            vals = vals - lse.index_select(0, plan.topk_rows)[:, None]  # [G, k], best first
        if greedy is not None:
            only_first = greedy.index_select(0, plan.topk_rows)[:, None] \
                & (torch.arange(plan.topk, device=vals.device) > 0)  # [G, k]
            vals = vals.masked_fill(only_first, float("-inf"))
        toks.append(idx.reshape(-1))
        lps.append(vals.reshape(-1))
    if plan.draw_rows is not None:
        sub = logits.index_select(0, plan.draw_rows)  # [D, V]
        drawn = draw(sub, plan.draw_temperature, plan.draw_top_p, plan.draw_generators)
        if greedy is not None:
            drawn = torch.where(greedy.index_select(0, plan.draw_rows),
                                tokens.index_select(0, plan.draw_rows), drawn)
        toks.append(drawn)
        lps.append(sub.gather(1, drawn[:, None])[:, 0] - lse.index_select(0, plan.draw_rows))
    return torch.cat(toks), torch.cat(lps)


def _topk_rows(logits: torch.Tensor, rows: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits[rows], k)``: on CUDA one Triton pass over each row
    (:mod:`edserve.kernels.row_topk`, no row copy, no radix select), else torch."""
    if _on_triton(logits):
        from edserve.kernels import row_topk  # here: CPU runs never import triton

        if k <= row_topk.MAX_K:
            return row_topk.row_topk(logits, rows, k)
    return torch.topk(logits.index_select(0, rows), k, dim=-1)


def row_candidates(plan: CandidatePlan | None, cands: tuple[list[int], list[float]] | None,
                   rows: frozenset[int] | None = None) -> dict[int, list[tuple[int, float]]]:
    """Per batch row that asked for candidates (only ``rows``, when given): its ``(token,
    log-prob)`` pairs, from the step's flat host lists
    (:meth:`~edserve.engine.step.StepOutput.fetch_candidates`)."""
    if plan is None or cands is None:
        return {}
    toks, lps = cands
    return {i: list(zip(toks[off:off + n], lps[off:off + n], strict=True))
            for i, off, n in plan.layout if rows is None or i in rows}


def _apply(group: FilterGroup, logits: torch.Tensor, ctx: FilterContext) -> None:
    for k, f in enumerate(group.filters):
        if f.per_row:
            type(f).apply_rows([chain[k] for chain in group.chains], logits, ctx)
        else:
            f.apply(logits, ctx)
