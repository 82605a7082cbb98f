"""One Triton program per beam group: a device beam step's whole choice in one launch.

The tensor-op version (:func:`edserve.engine.beam_choices.choose_by_ops`, the reference
and the CPU path) is ~230 small launches over ``[G, B, ...]`` shapes; even replayed as a CUDA
graph (194 kernels) they took 449 us of a ~10 ms beam step on the H200, this kernel 15.6 us
(64 groups of beam 5: benchmarks/RESULTS.md, wave 26). Here program ``g`` reads
group ``g``'s candidates and state once and writes the same results, bit for bit:

* candidate ``i`` is member ``k = i // T`` (slot ``rank_slot[g, k]``) and top-k place
  ``t = i % T`` (``T = W + 1``, ``W`` the widest beam admitted so far: members and places past
  a group's beam are never candidates, so only ``W * (W + 1)`` are looked at);
* the stable descending ranking is a ``[N, N]`` comparison (``j`` ranks above ``i`` when its
  score is larger, or equal with a smaller index); every running count of the tensor-op
  version ("kept so far, this one included") is then a row sum of that matrix;
* the new beams are picked by rank and given slots by ``[B, B]`` comparisons, as
  ``beam_choices._assign_slots`` does with scatters and cumulative sums;
* token histories (``[B, L]`` per group) move in column blocks: a block is loaded whole,
  then a CTA barrier, then stored, so no slot is overwritten before every slot has read it;
  the finished buffer copies its source beams before the first move (another barrier).

Scores are float64 as on the host. No host reads: safe under CUDA-graph capture. Sizes: the
comparison matrix is ``next_pow2(W * (W + 1))`` squared, so :func:`fits` limits the kernel to
``W <= MAX_WIDTH``; wider groups (beam_size up to 16) take the tensor-op path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_WIDTH = 8  # widest beam this kernel takes: 8 x 9 = 72 candidates -> a [128, 128] ranking
BLOCK_L = 64  # history columns moved per block


def fits(width: int) -> bool:
    """The kernel serves groups whose beams are at most ``width`` wide."""
    return 1 <= width <= MAX_WIDTH


def check_device(device: torch.device) -> None:
    """Raises ValueError where the kernel cannot run (not CUDA, no ``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton beam choice needs CUDA (or TRITON_INTERPRET=1 on CPU), "
                         f"not {device}; use the tensor ops (--beam-choice ops)")


@triton.jit
def _beam_choice_kernel(
    CandTok, CandLp, AtLimit, Beam, MaxCand, Stop, Live, Sums, Tokens, Logprobs, Length,
    RankSlot, FinTokens, FinLogprobs, FinLen, FinSum, FinStop, FinN, Done,
    Parents, NewTok, Lead,
    stride_cg, stride_cb, S, L, F,
    B: tl.constexpr, BP: tl.constexpr, T: tl.constexpr, NP: tl.constexpr,
    SP: tl.constexpr, BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    active = tl.load(Done + g) == 0
    beam = tl.load(Beam + g)
    max_cand = tl.load(MaxCand + g)
    fin_n = tl.load(FinN + g)
    length = tl.load(Length + g)
    at_lim = tl.load(AtLimit + g) != 0

    # ---- the state by slot s (and by member rank r: the same range)
    s = tl.arange(0, BP)
    s_ok = s < B
    live_s = tl.load(Live + g * B + s, mask=s_ok, other=0) != 0
    sums_s = tl.load(Sums + g * B + s, mask=s_ok, other=0.0)
    rank_s = tl.load(RankSlot + g * B + s, mask=s_ok, other=0)  # [BP] slot of member r

    # ---- candidates: i = member k, place t
    i = tl.arange(0, NP)
    in_n = i < (T - 1) * T
    k = i // T
    t = i % T
    src = tl.load(RankSlot + g * B + k, mask=in_n, other=0)  # [NP] the member's slot
    live = tl.load(Live + g * B + src, mask=in_n, other=0) != 0
    lp = tl.load(CandLp + g * stride_cg + src * stride_cb + t, mask=in_n,
                 other=float("-inf")).to(tl.float64)
    tok = tl.load(CandTok + g * stride_cg + src * stride_cb + t, mask=in_n, other=0)
    base = tl.load(Sums + g * B + src, mask=in_n, other=0.0)
    valid = in_n & live & active & (t <= beam) & (lp > float("-inf"))
    score = tl.where(valid, base + lp, float("-inf"))  # [NP] float64

    # ---- the stable descending ranking: j ranks above i
    ii = i[:, None]
    jj = i[None, :]
    above = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (jj < ii))
    upto = above | (jj == ii)  # [NP, NP] j ranks at or above i
    sx = tl.arange(0, SP)
    stops = tl.load(Stop + g * S + sx, mask=sx < S, other=-1)
    is_stop = tl.sum((tok[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
    nonstop = valid & (is_stop == 0)
    kcount = tl.sum((upto & nonstop[None, :]).to(tl.int64), axis=1)  # kept so far, i included
    kept = nonstop & (kcount <= beam)
    looked = (kcount - nonstop.to(tl.int64)) < beam
    newly = valid & is_stop & looked
    ncount = tl.sum((upto & newly[None, :]).to(tl.int64), axis=1)
    accept = newly & (fin_n + ncount <= max_cand)
    fin_after = fin_n + tl.sum(accept.to(tl.int64), axis=0)
    nkept = tl.sum(kept.to(tl.int64), axis=0)
    done = active & ((fin_after >= max_cand) | at_lim | (nkept == 0))
    fill = kept & done & (fin_after + kcount <= beam)
    going = active & (done == 0)

    # ---- finished buffer: a stop candidate ends its source beam, a filling one extends it
    dest = tl.where(accept, fin_n + ncount - 1, tl.where(fill, fin_after + kcount - 1, -1))
    write = dest >= 0
    frow = g * F + dest
    tl.store(FinLen + frow, length + fill.to(tl.int64), mask=write)
    tl.store(FinSum + frow, score, mask=write)
    tl.store(FinStop + frow, tl.where(fill, float("nan"), lp), mask=write)
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, L, BLOCK):
        col = c0 + cols
        m2 = write[:, None] & (col < L)[None, :]
        at = (g * B + src)[:, None] * L + col[None, :]
        ext = fill[:, None] & (col[None, :] == length)
        rt = tl.where(ext, tok[:, None], tl.load(Tokens + at, mask=m2, other=0))
        rl = tl.where(ext, lp[:, None], tl.load(Logprobs + at, mask=m2, other=0.0))
        to = frow[:, None] * L + col[None, :]
        tl.store(FinTokens + to, rt, mask=m2)
        tl.store(FinLogprobs + to, rl, mask=m2)

    # ---- next beams by rank r (the (r+1)-th kept candidate), then their slots
    go = kept & (done == 0)
    r = s
    pick = go[None, :] & ((kcount - 1)[None, :] == r[:, None])  # [BP, NP]
    has = tl.sum(pick.to(tl.int32), axis=1) > 0
    src_r = tl.where(has, tl.sum(tl.where(pick, src[None, :], 0), axis=1), -1)
    tok_r = tl.sum(tl.where(pick, tok[None, :], 0), axis=1)
    sum_r = tl.sum(tl.where(pick, score[None, :], 0.0), axis=1)
    lp_r = tl.sum(tl.where(pick, lp[None, :], 0.0), axis=1)
    ok = src_r >= 0
    rr = r[:, None]
    rq = r[None, :]
    dup = (src_r[:, None] == src_r[None, :]) & ok[None, :] & (rq < rr)
    first = ok & (tl.sum(dup.to(tl.int32), axis=1) == 0)  # a source's first continuation
    used = tl.sum(((src_r[None, :] == s[:, None]) & first[None, :]).to(tl.int32), axis=1) > 0
    free = (used == 0) & s_ok  # [BP] by slot
    free_at = tl.sum((free[None, :] & (rq <= rr)).to(tl.int64), axis=1) - 1
    fork = ok & (first == 0)
    forks_upto = tl.sum((fork[None, :] & (rq <= rr)).to(tl.int64), axis=1)
    n_fork = tl.sum(fork.to(tl.int64), axis=0)
    n_ok = tl.sum(ok.to(tl.int64), axis=0)
    nth = tl.where(fork, forks_upto - 1, n_fork + r - n_ok)
    nth = tl.minimum(tl.maximum(nth, 0), B - 1)
    hit = free[None, :] & (free_at[None, :] == nth[:, None])  # [BP r, BP s]
    free_slot = tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0,
                         tl.sum(tl.where(hit, s[None, :], 0), axis=1), B)
    slot_r = tl.where(first, src_r, free_slot)  # [BP] the slot new beam r takes

    # ---- by slot: parent, token, sum, log-prob of the beam that lands there
    lands = (slot_r[None, :] == s[:, None]) & (r < B)[None, :]  # [BP s, BP r]
    par = tl.where(tl.sum(lands.to(tl.int32), axis=1) > 0,
                   tl.sum(tl.where(lands, src_r[None, :], 0), axis=1), -1)
    new_tok = tl.sum(tl.where(lands, tok_r[None, :], 0), axis=1)
    new_sum = tl.sum(tl.where(lands, sum_r[None, :], 0.0), axis=1)
    new_lp = tl.sum(tl.where(lands, lp_r[None, :], 0.0), axis=1)

    # ---- token histories: every slot takes its parent's row (dead slots: slot 0's)
    tl.debug_barrier()  # the finished buffer has read the old rows
    from_row = (g * B + tl.maximum(par, 0))[:, None] * L
    to_row = (g * B + s)[:, None] * L
    mv = (s_ok.to(tl.int32) * going.to(tl.int32)) != 0  # (the interpreter widens bool & scalar)
    for c0 in range(0, L, BLOCK):
        col = c0 + cols
        m2 = mv[:, None] & (col < L)[None, :]
        at_len = col[None, :] == length
        rt = tl.where(at_len, new_tok[:, None],
                      tl.load(Tokens + from_row + col[None, :], mask=m2, other=0))
        rl = tl.where(at_len, new_lp[:, None],
                      tl.load(Logprobs + from_row + col[None, :], mask=m2, other=0.0))
        tl.debug_barrier()  # every slot has read this block
        tl.store(Tokens + to_row + col[None, :], rt, mask=m2)
        tl.store(Logprobs + to_row + col[None, :], rl, mask=m2)

    # ---- the rest of the state, and the step's results
    tl.debug_barrier()  # every program lane has read the old live / sums / ranks
    tl.store(Sums + g * B + s, tl.where(going, new_sum, sums_s), mask=s_ok)
    tl.store(Live + g * B + s, tl.where(going, par >= 0, live_s & (done == 0)), mask=s_ok)
    tl.store(RankSlot + g * B + r, tl.where(going, slot_r, rank_s), mask=s_ok)
    tl.store(Length + g, length + going.to(tl.int64))
    tl.store(Done + g, (active == 0) | done)
    tl.store(FinN + g, fin_after + tl.sum(fill.to(tl.int64), axis=0))
    tl.store(Parents + g * B + s, par, mask=s_ok)
    tl.store(NewTok + g * B + s, new_tok, mask=s_ok)
    lead = tl.sum(tl.where(r == 0, src_r, 0), axis=0)
    tl.store(Lead + g, tl.where(going, lead, -1))


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def beam_choice(state: dict[str, torch.Tensor], width: int, cand_tokens: torch.Tensor,
                cand_logprobs: torch.Tensor, at_limit: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of every group in ``state`` (``BeamBatch.tensors()``: updated in place).

    cand_tokens ``[G, B, T]`` int64, cand_logprobs ``[G, B, T]`` (any float dtype; same
    strides as the tokens), at_limit ``[G]`` bool; ``width``: the widest beam admitted
    (``fits(width)``, ``T > width``). Returns ``parents [G, B]``, ``tokens [G, B]`` (int64) and
    ``lead [G]``, as ``beam_choices.choose_by_ops`` does."""
    live = state["live"]
    G, B = live.shape
    L, F, S = state["tokens"].shape[2], state["fin_tokens"].shape[1], state["stop"].shape[1]
    if not fits(width) or cand_tokens.shape[:2] != (G, B) or cand_tokens.shape[2] <= width:
        raise ValueError(f"beam_choice: need width 1..{MAX_WIDTH} and [G={G}, B={B}, T > "
                         f"{width}] candidates, got width {width}, {tuple(cand_tokens.shape)}")
    if cand_logprobs.shape != cand_tokens.shape or cand_logprobs.stride() != cand_tokens.stride() \
            or cand_tokens.stride(2) != 1:
        raise ValueError("beam_choice: candidate tokens and log-probs need one layout with "
                         "contiguous places")
    for name, tensor in state.items():
        if not tensor.is_contiguous():
            raise ValueError(f"beam_choice: state tensor {name!r} must be contiguous")
    dev = live.device
    check_device(dev)
    parents = torch.empty(G, B, dtype=torch.int64, device=dev)
    new_tok = torch.empty(G, B, dtype=torch.int64, device=dev)
    lead = torch.empty(G, dtype=torch.int64, device=dev)
    T = width + 1
    _beam_choice_kernel[(G,)](
        cand_tokens, cand_logprobs, at_limit, state["beam"], state["max_cand"], state["stop"],
        live, state["sums"], state["tokens"], state["logprobs"], state["length"],
        state["rank_slot"], state["fin_tokens"], state["fin_logprobs"], state["fin_len"],
        state["fin_sum"], state["fin_stop"], state["fin_n"], state["done"],
        parents, new_tok, lead, cand_tokens.stride(0), cand_tokens.stride(1), S, L, F,
        B=B, BP=_pow2(B), T=T, NP=_pow2(width * T), SP=_pow2(S), BLOCK=BLOCK_L, num_warps=4)
    return parents, new_tok, lead
