"""Beam choice on the device: :class:`~edserve.engine.beam_search.BeamGroup`'s step as tensor
ops over every beam group of a batch, so the host need only learn which groups are done.

Each group has ``B`` fixed *slots* (rows; the largest beam size): ``rank_slot[g, k]`` is the
slot of the group's ``k``-th beam in the host version's member order (which breaks ties). A
step's result is a parent slot per slot plus its new token, which the engine applies to rows,
page tables and token histories as gathers; a beam's first continuation stays in its slot and
only the others move (a moved row copies its partial last page). Nothing here reads a value on
the host except :meth:`BeamBatch.finished`, called once for the groups done at a step.

Semantics are openai-whisper's, exactly as ``BeamGroup.update`` implements them (its tests are
the oracle; ``tests/engine/test_beam_device.py`` replays random steps through both):

- a candidate is ``(slot, token)`` among the slot's ``beam + 1`` most likely tokens (log-prob
  ``-inf``: not a choice); its score is the beam's sum log-probability plus the token's, in
  float64 like the host's Python floats;
- candidates are ranked by score, best first, ties in (slot, top-k) order (a stable sort, like
  the host's ``sorted`` over an insertion-ordered dict). The host keys candidates by their
  whole sequence; no two candidates ever share one (live beams are distinct sequences, and a
  slot's top-k tokens are distinct), so the collapse needs no tensor op;
- walking the ranking, stop tokens are *newly finished* and the rest are kept until ``beam``
  are; candidates below the ``beam``-th kept one are not looked at. Newly finished ones join
  the group's finished buffer, best first, while it holds fewer than
  ``round(beam * patience)``; the group is done when it is full, at the length limit, or when
  nothing is kept; a done group's kept candidates then fill the buffer up to ``beam``.

Layout (``G`` groups, ``B`` slots, ``T = B + 1`` candidates per slot, ``L`` tokens, ``F`` the
finished buffer's capacity ``max(beam, round(beam * patience))`` over the groups)::

    live      bool    [G, B]        slot holds a beam
    sums      float64 [G, B]        its sum log-probability
    tokens    int64   [G, B, L]     its generated tokens (the first ``length[g]`` columns)
    logprobs  float64 [G, B, L]
    length    int64   [G]           tokens of the group's live beams (all the same)
    fin_*     [G, F, ...]           finished sequences: tokens, logprobs, length, sum, stop lp
    fin_n     int64   [G]           entries of the finished buffer
    done      bool    [G]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.host_copy import to_device
from edserve.engine.row_group import Finished
from edserve.kernels import beam_choice as choice_kernel


@dataclass
class BeamChoice:
    """One step's decision for every group (device tensors)."""

    parents: torch.Tensor  # [G, B] int64 slot each new beam continues (-1: no beam there)
    tokens: torch.Tensor  # [G, B] int64 its new token (0 where no beam)
    done: torch.Tensor  # [G] bool the group finished at this step (or before)
    lead: torch.Tensor  # [G] int64 the best new beam's parent slot (-1: the group is done)


class BeamBatch:
    """The beam state of up to ``capacity`` groups (see the module doc), one *group slot*
    each: :meth:`admit` starts a group in a slot, :meth:`step` advances every admitted group
    that is not done, :meth:`release` frees the slot. Nothing here waits for the device except
    :meth:`finished`.

    ``choice`` names how :meth:`step` runs (:data:`BEAM_CHOICES`): ``"ops"``, the tensor ops of
    :meth:`step_ops` (any device; the reference), or ``"triton"``, one kernel launch
    (:mod:`edserve.kernels.beam_choice`: the same results bit for bit) while every admitted
    beam fits it, else the ops. None: Triton on CUDA, the ops elsewhere."""

    def __init__(self, capacity: int, max_beam: int, max_tokens: int,
                 device: torch.device | str = "cpu", choice: str | None = None) -> None:
        if capacity < 1 or max_beam < 1 or max_tokens < 1:
            raise ValueError(f"BeamBatch: capacity, max_beam and max_tokens must be >= 1, got "
                             f"{capacity}, {max_beam}, {max_tokens}")
        dev = self.device = torch.device(device)
        choice = choice or ("triton" if dev.type == "cuda" else "ops")
        if choice not in BEAM_CHOICES:
            raise ValueError(f"unknown beam choice {choice!r}; known: {sorted(BEAM_CHOICES)}")
        if choice == "triton":
            choice_kernel.check_device(dev)
        self.choice = choice
        self.width = 1  # widest beam admitted so far (host-known: the kernel's shapes)
        G, B, L = self.G, self.B, self.L = capacity, max_beam, max_tokens
        F = self.F = B  # finished buffer; admit() widens it to round(beam * patience)
        i64, f64 = torch.int64, torch.float64
        self.beam = torch.ones(G, dtype=i64, device=dev)  # [G]
        self.max_cand = torch.ones(G, dtype=i64, device=dev)  # [G]
        self.stop = torch.full((G, 1), -1, dtype=i64, device=dev)  # [G, S] -1 padded
        self.live = torch.zeros(G, B, dtype=torch.bool, device=dev)
        self.sums = torch.zeros(G, B, dtype=f64, device=dev)
        self.tokens = torch.zeros(G, B, L, dtype=i64, device=dev)
        self.logprobs = torch.zeros(G, B, L, dtype=f64, device=dev)
        self.length = torch.zeros(G, dtype=i64, device=dev)
        self.rank_slot = torch.arange(B, device=dev).repeat(G, 1)  # [G, B] member k's slot
        self.fin_tokens = torch.zeros(G, F, L, dtype=i64, device=dev)
        self.fin_logprobs = torch.zeros(G, F, L, dtype=f64, device=dev)
        self.fin_len = torch.zeros(G, F, dtype=i64, device=dev)
        self.fin_sum = torch.zeros(G, F, dtype=f64, device=dev)
        self.fin_stop = torch.full((G, F), float("nan"), dtype=f64, device=dev)  # NaN: length
        self.fin_n = torch.zeros(G, dtype=i64, device=dev)
        self.done = torch.ones(G, dtype=torch.bool, device=dev)  # free slots count as done

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor by name (a graph's warm-up saves and restores them)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def admit(self, slot: int, beam: int, patience: float | None,
              stop_ids: frozenset[int]) -> None:
        """Start a group in ``slot``: one live beam (the prefilled row), nothing finished."""
        max_cand = round(beam * (patience or 1.0))
        if not 1 <= beam <= self.B or max_cand < 1:
            raise ValueError(f"beam_size must be 1..{self.B} and beam_size * patience round to "
                             f">= 1, got {beam} * {patience}")
        if max_cand > self.F:
            self._widen(max_cand)
        self.width = max(self.width, beam)
        if len(stop_ids) > self.stop.shape[1]:  # widen the stop table (host-known shape)
            pad = torch.full((self.G, len(stop_ids) - self.stop.shape[1]), -1,
                             dtype=torch.int64, device=self.device)
            self.stop = torch.cat([self.stop, pad], 1)
        S = self.stop.shape[1]
        vals = to_device([beam, max_cand] + sorted(stop_ids) + [-1] * (S - len(stop_ids)),
                         torch.int64, self.device)
        self.beam[slot], self.max_cand[slot] = vals[0], vals[1]
        self.stop[slot] = vals[2:]
        self.live[slot] = False
        self.live[slot, 0] = True
        self.sums[slot] = 0.0
        self.length[slot] = 0
        self.rank_slot[slot] = torch.arange(self.B, device=self.device)
        self.fin_n[slot] = 0
        self.done[slot] = False

    def _widen(self, F: int) -> None:
        """Room for ``F`` finished sequences per group (host-known shapes: no sync)."""
        more = F - self.F

        def grow(buf: torch.Tensor, fill: float) -> torch.Tensor:
            pad = torch.full((self.G, more, *buf.shape[2:]), fill, dtype=buf.dtype,
                             device=self.device)
            return torch.cat([buf, pad], 1)

        self.fin_tokens, self.fin_logprobs = grow(self.fin_tokens, 0), grow(self.fin_logprobs, 0)
        self.fin_len, self.fin_sum = grow(self.fin_len, 0), grow(self.fin_sum, 0)
        self.fin_stop = grow(self.fin_stop, float("nan"))
        self.F = F

    def release(self, slot: int) -> None:
        """The group in ``slot`` is over (finished and read, or aborted)."""
        self.done[slot] = True
        self.live[slot] = False

    def shape_key(self) -> tuple[str, int, int, int]:
        """Everything the launches of :meth:`step` depend on besides the batch's capacity (a
        captured graph is valid while it stays the same)."""
        return self.choice, self.width, self.F, self.stop.shape[1]

    def step(self, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
             at_limit: torch.Tensor) -> BeamChoice:
        """Rank one step's candidates and rearrange the slots; no host sync.

        cand_tokens: [G, B, T] int64 each slot's top-T tokens, best first (T >= B + 1; a group
        reads its first ``beam + 1``); cand_logprobs: [G, B, T] their log-probabilities (any
        float dtype); at_limit: [G] bool no further step is allowed. Entries of dead slots and
        of groups already done are ignored."""
        return BEAM_CHOICES[self.choice](self, cand_tokens, cand_logprobs, at_limit)

    def step_triton(self, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
                    at_limit: torch.Tensor) -> BeamChoice:
        """:meth:`step` as one kernel launch (groups up to ``beam_choice.MAX_WIDTH`` wide)."""
        if not choice_kernel.fits(self.width):
            return self.step_ops(cand_tokens, cand_logprobs, at_limit)
        parents, tokens, lead = choice_kernel.beam_choice(
            self.tensors(), self.width, cand_tokens, cand_logprobs, at_limit)
        return BeamChoice(parents, tokens, self.done, lead)

    def step_ops(self, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
                 at_limit: torch.Tensor) -> BeamChoice:
        """:meth:`step` as tensor ops (any device)."""
        G, B, L = self.G, self.B, self.L
        T = cand_tokens.shape[2]
        dev = self.live.device
        active = ~self.done  # [G]
        o = self.rank_slot  # [G, B] the slot of each beam, in member order (ties)
        o3 = o[:, :, None].expand(G, B, T)
        lp = cand_logprobs.to(torch.float64).gather(1, o3)  # [G, B, T] member order
        ct = cand_tokens.gather(1, o3)
        t_idx = torch.arange(T, device=dev)
        valid = (self.live.gather(1, o) & active[:, None])[:, :, None] \
            & (t_idx[None, None, :] <= self.beam[:, None, None]) & (lp > float("-inf"))
        score = torch.where(valid, self.sums.gather(1, o)[:, :, None] + lp,
                            float("-inf")).reshape(G, B * T)
        order = torch.sort(score, dim=1, descending=True, stable=True).indices  # [G, N]
        s_score = score.gather(1, order)
        s_tok = ct.reshape(G, B * T).gather(1, order)
        s_lp = lp.reshape(G, B * T).gather(1, order)
        s_valid = valid.reshape(G, B * T).gather(1, order)
        s_src = o.gather(1, order // T)  # [G, N] source slot
        is_stop = (s_tok[:, :, None] == self.stop[:, None, :]).any(-1)  # [G, N]
        nonstop = s_valid & ~is_stop
        kcount = torch.cumsum(nonstop.long(), 1)  # [G, N] kept so far, this one included
        beam = self.beam[:, None]
        kept = nonstop & (kcount <= beam)
        looked = (kcount - nonstop.long()) < beam  # ranked above the beam-th kept one
        newly = s_valid & is_stop & looked
        ncount = torch.cumsum(newly.long(), 1)
        fin_n = self.fin_n[:, None]
        accept = newly & (fin_n + ncount <= self.max_cand[:, None])  # [G, N]
        fin_after = self.fin_n + accept.long().sum(1)  # [G]
        nkept = kept.long().sum(1)  # [G]
        done = active & ((fin_after >= self.max_cand) | at_limit | (nkept == 0))
        fill = kept & done[:, None] & (fin_after[:, None] + kcount <= beam)  # [G, N]

        # finished buffer: a stop candidate ends its source beam (tokens as they are, the stop
        # token's log-prob counts); a filling one is the source beam plus its token
        col = torch.arange(L, device=dev)[None, None, :]
        at_len = col == self.length[:, None, None]  # [G, 1, L] the next column
        dest = torch.where(accept, fin_n + ncount - 1,
                           torch.where(fill, fin_after[:, None] + kcount - 1, self.F))  # [G, N]
        self._write_finished(dest, s_src, s_tok, s_lp, s_score, fill, at_len)
        self.fin_n.copy_(fin_after + fill.long().sum(1))

        # next beams, in member order: the (k+1)-th kept candidate is beam k; a source's
        # first continuation stays in its slot, the others take free slots (fewest moves)
        go = kept & ~done[:, None]
        rank = torch.where(go, kcount - 1, B)  # [G, N] B: nowhere

        def by_rank(v: torch.Tensor, fill) -> torch.Tensor:  # [G, N] -> [G, B] per new beam
            out = torch.full((G, B + 1), fill, dtype=v.dtype, device=dev)
            return out.scatter_(1, rank, torch.where(go, v, fill))[:, :B]

        src_r, tok_r = by_rank(s_src, -1), by_rank(s_tok, 0)
        sum_r, lp_r = by_rank(s_score, 0.0), by_rank(s_lp, 0.0)
        slot = self._assign_slots(src_r)  # [G, B] slot of each new beam (a permutation)
        parents = torch.full((G, B), -1, dtype=torch.int64, device=dev).scatter_(1, slot, src_r)
        new_tok = torch.zeros(G, B, dtype=torch.int64, device=dev).scatter_(1, slot, tok_r)
        new_sum = torch.zeros(G, B, dtype=torch.float64, device=dev).scatter_(1, slot, sum_r)
        new_lp = torch.zeros(G, B, dtype=torch.float64, device=dev).scatter_(1, slot, lp_r)
        going = active & ~done  # [G]
        src = parents.clamp(min=0)[:, :, None].expand(G, B, L)
        moved_tok = torch.where(at_len, new_tok[:, :, None], self.tokens.gather(1, src))
        moved_lp = torch.where(at_len, new_lp[:, :, None], self.logprobs.gather(1, src))
        g3 = going[:, None, None]
        self.tokens.copy_(torch.where(g3, moved_tok, self.tokens))
        self.logprobs.copy_(torch.where(g3, moved_lp, self.logprobs))
        self.sums.copy_(torch.where(going[:, None], new_sum, self.sums))
        self.live.copy_(torch.where(going[:, None], parents >= 0, self.live & ~done[:, None]))
        self.length.copy_(self.length + going.long())
        self.rank_slot.copy_(torch.where(going[:, None], slot, self.rank_slot))
        self.done.copy_(self.done | done)
        return BeamChoice(parents, new_tok, self.done, torch.where(going, src_r[:, 0], -1))

    def _assign_slots(self, src: torch.Tensor) -> torch.Tensor:
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

    def _write_finished(self, dest: torch.Tensor, src: torch.Tensor, tok: torch.Tensor,
                        lp: torch.Tensor, score: torch.Tensor, fill: torch.Tensor,
                        at_len: torch.Tensor) -> None:
        """Candidates (sorted, [G, N] each) join the finished buffer at ``dest`` (``F``:
        none): a stop candidate as its source beam, a filling one (``fill``) as its source
        beam plus its token (at the ``at_len`` column)."""
        G, F, L, N = self.G, self.F, self.L, dest.shape[1]
        dev = dest.device
        writer = torch.full((G, F + 1), -1, dtype=torch.int64, device=dev).scatter_(
            1, dest, torch.arange(N, device=dev).expand(G, N))[:, :F]  # [G, F] candidate
        w = writer >= 0
        wn = writer.clamp(min=0)
        w_src, w_tok, w_lp = src.gather(1, wn), tok.gather(1, wn), lp.gather(1, wn)
        w_fill = fill.gather(1, wn)
        idx = w_src[:, :, None].expand(G, F, L)
        ext = w_fill[:, :, None] & at_len  # [G, F, L]
        seq_tok = torch.where(ext, w_tok[:, :, None], self.tokens.gather(1, idx))
        seq_lp = torch.where(ext, w_lp[:, :, None], self.logprobs.gather(1, idx))
        w3 = w[:, :, None]
        self.fin_tokens.copy_(torch.where(w3, seq_tok, self.fin_tokens))
        self.fin_logprobs.copy_(torch.where(w3, seq_lp, self.fin_logprobs))
        self.fin_len.copy_(torch.where(w, self.length[:, None] + w_fill.long(), self.fin_len))
        self.fin_sum.copy_(torch.where(w, score.gather(1, wn), self.fin_sum))
        self.fin_stop.copy_(torch.where(w, torch.where(w_fill, float("nan"), w_lp), self.fin_stop))

    def finished(self, slots: list[int]) -> list[list[Finished]]:
        """The finished sequences of the groups in ``slots``, in the host's order (one read
        of the host for all: the integers travel as float64, exact below 2**53)."""
        idx = to_device(slots, torch.int64, self.device)
        n = len(slots)
        flat = torch.cat([self.fin_n[idx][:, None].double(), self.fin_len[idx].double(),
                          self.fin_sum[idx], self.fin_stop[idx],
                          self.fin_tokens[idx].reshape(n, -1).double(),
                          self.fin_logprobs[idx].reshape(n, -1)], 1).tolist()
        F, L = self.F, self.L
        out = []
        for row in flat:  # [1 + 3F + 2FL]: n, lengths, sums, stop lps, tokens, log-probs
            lens = [int(x) for x in row[1:1 + F]]
            sums, stops = row[1 + F:1 + 2 * F], row[1 + 2 * F:1 + 3 * F]
            toks, lps = row[1 + 3 * F:1 + 3 * F + F * L], row[1 + 3 * F + F * L:]
            out.append([Finished([int(t) for t in toks[f * L:f * L + lens[f]]],
                                 lps[f * L:f * L + lens[f]], sums[f],
                                 None if stops[f] != stops[f] else stops[f])
                        for f in range(int(row[0]))])
        return out


#: How :meth:`BeamBatch.step` runs, by name (``BeamBatch(choice=...)``).
BEAM_CHOICES = {"ops": BeamBatch.step_ops, "triton": BeamBatch.step_triton}
