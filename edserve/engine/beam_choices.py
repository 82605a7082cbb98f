"""How a device beam step is chosen: :meth:`~edserve.engine.beam_device.BeamBatch.step`'s
implementations, by name (:data:`BEAM_CHOICES`), and the :class:`BeamChoice` they return.

``"ops"`` (:func:`choose_by_ops`) is the step as tensor ops over every group at once (any
device: the reference, and the CPU's); ``"triton"`` (:func:`choose_by_kernel`) is one launch of
:mod:`edserve.kernels.beam_choice`, bit for bit the same results and state. The semantics
(openai-whisper's beam search) and the state's layout are in :mod:`edserve.engine.beam_device`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The state these functions read and update: edserve.engine.beam_device.BeamBatch, which
# imports this module (its step dispatches here), so it is typed Any here.
BeamBatch = Any


@dataclass
class BeamChoice:
    """One step's decision for every group (device tensors)."""

    parents: torch.Tensor  # [G, B] int64 slot each new beam continues (-1: no beam there)
    tokens: torch.Tensor  # [G, B] int64 its new token (0 where no beam)
    done: torch.Tensor  # [G] bool the group finished at this step (or before)
    lead: torch.Tensor  # [G] int64 the best new beam's parent slot (-1: the group is done)


def choose_by_kernel(st: BeamBatch, cand_tokens: torch.Tensor,
                     cand_logprobs: torch.Tensor, at_limit: torch.Tensor) -> BeamChoice:
    """The step as one Triton launch (:mod:`edserve.kernels.beam_choice`) while the widest
    admitted beam fits it (``MAX_WIDTH``), else :func:`choose_by_ops`."""
    from edserve.kernels import beam_choice as choice_kernel  # triton: imported when used

    if not choice_kernel.fits(st.width):
        return choose_by_ops(st, cand_tokens, cand_logprobs, at_limit)
    parents, tokens, lead = choice_kernel.beam_choice(
        st.tensors(), st.width, cand_tokens, cand_logprobs, at_limit)
    return BeamChoice(parents, tokens, st.done, lead)


def choose_by_ops(st: BeamBatch, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
                  at_limit: torch.Tensor) -> BeamChoice:
    """The step as ~230 tensor ops (any device): the reference the kernel equals."""
    G, B, L = st.G, st.B, st.L
    T = cand_tokens.shape[2]
    dev = st.live.device
    active = ~st.done  # [G]
    o = st.rank_slot  # [G, B] the slot of each beam, in member order (ties)
    o3 = o[:, :, None].expand(G, B, T)
    lp = cand_logprobs.to(torch.float64).gather(1, o3)  # [G, B, T] member order
    ct = cand_tokens.gather(1, o3)
    t_idx = torch.arange(T, device=dev)
    valid = (st.live.gather(1, o) & active[:, None])[:, :, None] \
        & (t_idx[None, None, :] <= st.beam[:, None, None]) & (lp > float("-inf"))
    score = torch.where(valid, st.sums.gather(1, o)[:, :, None] + lp,
                        float("-inf")).reshape(G, B * T)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices  # [G, N]
    s_score = score.gather(1, order)
    s_tok = ct.reshape(G, B * T).gather(1, order)
    s_lp = lp.reshape(G, B * T).gather(1, order)
    s_valid = valid.reshape(G, B * T).gather(1, order)
    s_src = o.gather(1, order // T)  # [G, N] source slot
    is_stop = (s_tok[:, :, None] == st.stop[:, None, :]).any(-1)  # [G, N]
    nonstop = s_valid & ~is_stop
    kcount = torch.cumsum(nonstop.long(), 1)  # [G, N] kept so far, this one included
    beam = st.beam[:, None]
    kept = nonstop & (kcount <= beam)
    looked = (kcount - nonstop.long()) < beam  # ranked above the beam-th kept one
    newly = s_valid & is_stop & looked
    ncount = torch.cumsum(newly.long(), 1)
    fin_n = st.fin_n[:, None]
    accept = newly & (fin_n + ncount <= st.max_cand[:, None])  # [G, N]
    fin_after = st.fin_n + accept.long().sum(1)  # [G]
    nkept = kept.long().sum(1)  # [G]
    done = active & ((fin_after >= st.max_cand) | at_limit | (nkept == 0))
    fill = kept & done[:, None] & (fin_after[:, None] + kcount <= beam)  # [G, N]

    # finished buffer: a stop candidate ends its source beam (tokens as they are, the stop
    # token's log-prob counts); a filling one is the source beam plus its token
    col = torch.arange(L, device=dev)[None, None, :]
    at_len = col == st.length[:, None, None]  # [G, 1, L] the next column
    dest = torch.where(accept, fin_n + ncount - 1,
                       torch.where(fill, fin_after[:, None] + kcount - 1, st.F))  # [G, N]
    _write_finished(st, dest, s_src, s_tok, s_lp, s_score, fill, at_len)
    st.fin_n.copy_(fin_after + fill.long().sum(1))

    # next beams, in member order: the (k+1)-th kept candidate is beam k; a source's
    # first continuation stays in its slot, the others take free slots (fewest moves)
    go = kept & ~done[:, None]
    rank = torch.where(go, kcount - 1, B)  # [G, N] B: nowhere

    def by_rank(v: torch.Tensor, fill) -> torch.Tensor:  # [G, N] -> [G, B] per new beam
        out = torch.full((G, B + 1), fill, dtype=v.dtype, device=dev)
        return out.scatter_(1, rank, torch.where(go, v, fill))[:, :B]

    src_r, tok_r = by_rank(s_src, -1), by_rank(s_tok, 0)
    sum_r, lp_r = by_rank(s_score, 0.0), by_rank(s_lp, 0.0)
    slot = _assign_slots(src_r)  # [G, B] slot of each new beam (a permutation)
    parents = torch.full((G, B), -1, dtype=torch.int64, device=dev).scatter_(1, slot, src_r)
    new_tok = torch.zeros(G, B, dtype=torch.int64, device=dev).scatter_(1, slot, tok_r)
    new_sum = torch.zeros(G, B, dtype=torch.float64, device=dev).scatter_(1, slot, sum_r)
    new_lp = torch.zeros(G, B, dtype=torch.float64, device=dev).scatter_(1, slot, lp_r)
    going = active & ~done  # [G]
    src = parents.clamp(min=0)[:, :, None].expand(G, B, L)
    moved_tok = torch.where(at_len, new_tok[:, :, None], st.tokens.gather(1, src))
    moved_lp = torch.where(at_len, new_lp[:, :, None], st.logprobs.gather(1, src))
    g3 = going[:, None, None]
    st.tokens.copy_(torch.where(g3, moved_tok, st.tokens))
    st.logprobs.copy_(torch.where(g3, moved_lp, st.logprobs))
    st.sums.copy_(torch.where(going[:, None], new_sum, st.sums))
    st.live.copy_(torch.where(going[:, None], parents >= 0, st.live & ~done[:, None]))
    st.length.copy_(st.length + going.long())
    st.rank_slot.copy_(torch.where(going[:, None], slot, st.rank_slot))
    st.done.copy_(st.done | done)
    return BeamChoice(parents, new_tok, st.done, torch.where(going, src_r[:, 0], -1))


def _assign_slots(src: torch.Tensor) -> torch.Tensor:
    """[G, B] new beams' source slots (member order, -1: none) -> the slot each takes: a
    source's first continuation keeps the source's slot, the others take the free slots
    in order, beams that do not exist the rest (a permutation of the slots)."""
    G, B = src.shape
    dev = src.device
    ok = src >= 0
    same = (src[:, :, None] == src[:, None, :]) & ok[:, None, :]  # [G, k, k']
    earlier = torch.ones(B, B, dtype=torch.bool, device=dev).tril(-1)  # k' < k
    first = ok & ~(same & earlier).any(-1)  # [G, B]
    used = torch.zeros(G, B + 1, dtype=torch.bool, device=dev).scatter_(
        1, torch.where(first, src, B), True)[:, :B]  # slots kept by a first continuation
    free_at = torch.cumsum((~used).long(), 1) - 1  # [G, B] position among free slots
    free = torch.full((G, B + 1), B, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(used, B, free_at), torch.arange(B, device=dev).expand(G, B))[:, :B]
    fork = ok & ~first
    nth = torch.where(fork, torch.cumsum(fork.long(), 1) - 1,
                      fork.long().sum(1, keepdim=True)
                      + torch.arange(B, device=dev) - ok.long().sum(1, keepdim=True))
    return torch.where(first, src, free.gather(1, nth.clamp(0, B - 1)))


def _write_finished(st: BeamBatch, dest: torch.Tensor, src: torch.Tensor, tok: torch.Tensor,
                    lp: torch.Tensor, score: torch.Tensor, fill: torch.Tensor,
                    at_len: torch.Tensor) -> None:
    """Candidates (sorted, [G, N] each) join the finished buffer at ``dest`` (``F``:
    none): a stop candidate as its source beam, a filling one (``fill``) as its source
    beam plus its token (at the ``at_len`` column)."""
    G, F, L, N = st.G, st.F, st.L, dest.shape[1]
    dev = dest.device
    writer = torch.full((G, F + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, dest, torch.arange(N, device=dev).expand(G, N))[:, :F]  # [G, F] candidate
    w = writer >= 0
    wn = writer.clamp(min=0)
    w_src, w_tok, w_lp = src.gather(1, wn), tok.gather(1, wn), lp.gather(1, wn)
    w_fill = fill.gather(1, wn)
    idx = w_src[:, :, None].expand(G, F, L)
    ext = w_fill[:, :, None] & at_len  # [G, F, L]
    seq_tok = torch.where(ext, w_tok[:, :, None], st.tokens.gather(1, idx))
    seq_lp = torch.where(ext, w_lp[:, :, None], st.logprobs.gather(1, idx))
    w3 = w[:, :, None]
    st.fin_tokens.copy_(torch.where(w3, seq_tok, st.fin_tokens))
    st.fin_logprobs.copy_(torch.where(w3, seq_lp, st.fin_logprobs))
    st.fin_len.copy_(torch.where(w, st.length[:, None] + w_fill.long(), st.fin_len))
    st.fin_sum.copy_(torch.where(w, score.gather(1, wn), st.fin_sum))
    st.fin_stop.copy_(torch.where(w, torch.where(w_fill, float("nan"), w_lp), st.fin_stop))


#: How ``BeamBatch.step`` runs, by name (``BeamBatch(choice=...)``).
BEAM_CHOICES: dict[str, Callable[..., BeamChoice]] = {"ops": choose_by_ops,
                                                      "triton": choose_by_kernel}


def check_choice(name: str, device: torch.device) -> str:
    """``name`` if it is a known choice that can run on ``device``, else ValueError."""
    if name not in BEAM_CHOICES:
        raise ValueError(f"unknown beam choice {name!r}; known: {sorted(BEAM_CHOICES)}")
    if name == "triton":
        from edserve.kernels.beam_choice import check_device

        check_device(device)
    return name
