"""Beam choice on the device: :class:`~edserve.engine.beam_search.BeamGroup`'s step as tensor
ops over every beam group of a batch, so the host need only learn which groups are done.

Each group has ``B`` fixed *slots* (its beam size, padded to the batch's largest): slot ``b``
holds the group's ``b``-th best live beam (the host version's member order), so a step's
result is a parent index per slot (the slot it continues) plus its new token, which the engine
can apply to rows, page tables and token histories as gathers. Nothing here reads a value on
the host except :meth:`BeamBatch.finished`, called once per group when it is done.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edserve.engine.row_group import Finished


@dataclass
class BeamChoice:
    """One step's decision for every group (device tensors)."""

    parents: torch.Tensor  # [G, B] int64 slot each new beam continues (-1: no beam there)
    tokens: torch.Tensor  # [G, B] int64 its new token (0 where no beam)
    done: torch.Tensor  # [G] bool the group finished at this step (or before)


class BeamBatch:
    """The beam state of ``G`` groups (see the module doc); ``step`` is sync-free."""

    def __init__(self, beam_sizes: Sequence[int], patience: Sequence[float | None],
                 stop_ids: Sequence[frozenset[int]], max_tokens: int,
                 device: torch.device | str = "cpu") -> None:
        if not len(beam_sizes) == len(patience) == len(stop_ids):
            raise ValueError("BeamBatch: beam_sizes, patience and stop_ids differ in length")
        max_cand = [round(b * (p or 1.0)) for b, p in zip(beam_sizes, patience, strict=True)]
        for b, p, m in zip(beam_sizes, patience, max_cand, strict=True):
            if b < 1 or m < 1:
                raise ValueError(f"beam_size * patience must round to >= 1, got {b} * {p}")
        dev = torch.device(device)
        G, B, L = len(beam_sizes), max(beam_sizes, default=1), max_tokens
        F = max((max(b, m) for b, m in zip(beam_sizes, max_cand, strict=True)), default=1)
        S = max((len(s) for s in stop_ids), default=0) or 1
        i64, f64 = torch.int64, torch.float64
        self.G, self.B, self.L, self.F = G, B, L, F
        self.beam = torch.tensor(list(beam_sizes), dtype=i64, device=dev)  # [G]
        self.max_cand = torch.tensor(max_cand, dtype=i64, device=dev)  # [G]
        self.stop = torch.tensor([sorted(s) + [-1] * (S - len(s)) for s in stop_ids],
                                 dtype=i64, device=dev).reshape(G, S)  # [G, S] -1 padded
        self.live = torch.zeros(G, B, dtype=torch.bool, device=dev)
        self.live[:, 0] = True  # the prefilled row: one beam
        self.sums = torch.zeros(G, B, dtype=f64, device=dev)
        self.tokens = torch.zeros(G, B, L, dtype=i64, device=dev)
        self.logprobs = torch.zeros(G, B, L, dtype=f64, device=dev)
        self.length = torch.zeros(G, dtype=i64, device=dev)
        self.fin_tokens = torch.zeros(G, F, L, dtype=i64, device=dev)
        self.fin_logprobs = torch.zeros(G, F, L, dtype=f64, device=dev)
        self.fin_len = torch.zeros(G, F, dtype=i64, device=dev)
        self.fin_sum = torch.zeros(G, F, dtype=f64, device=dev)
        self.fin_stop = torch.full((G, F), float("nan"), dtype=f64, device=dev)  # NaN: length
        self.fin_n = torch.zeros(G, dtype=i64, device=dev)
        self.done = torch.zeros(G, dtype=torch.bool, device=dev)

    def step(self, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
             at_limit: torch.Tensor) -> BeamChoice:
        """Rank one step's candidates and rearrange the slots; no host sync.

        cand_tokens: [G, B, T] int64 each slot's top-T tokens, best first (T >= B + 1; a group
        reads its first ``beam + 1``); cand_logprobs: [G, B, T] their log-probabilities (any
        float dtype); at_limit: [G] bool no further step is allowed. Entries of dead slots and
        of groups already done are ignored."""
        G, B, L = self.G, self.B, self.L
        T = cand_tokens.shape[2]
        dev = self.live.device
        active = ~self.done  # [G]
        lp = cand_logprobs.to(torch.float64)
        t_idx = torch.arange(T, device=dev)
        valid = (self.live & active[:, None])[:, :, None] \
            & (t_idx[None, None, :] <= self.beam[:, None, None]) & (lp > float("-inf"))
        score = torch.where(valid, self.sums[:, :, None] + lp, float("-inf")).reshape(G, B * T)
        order = torch.sort(score, dim=1, descending=True, stable=True).indices  # [G, N]
        s_score = score.gather(1, order)
        s_tok = cand_tokens.reshape(G, B * T).gather(1, order)
        s_lp = lp.reshape(G, B * T).gather(1, order)
        s_valid = valid.reshape(G, B * T).gather(1, order)
        s_src = order // T  # [G, N] source slot
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
        src_tok = self.tokens.gather(1, s_src[:, :, None].expand(G, -1, L))  # [G, N, L]
        src_lp = self.logprobs.gather(1, s_src[:, :, None].expand(G, -1, L))
        col = torch.arange(L, device=dev)[None, None, :]
        at_len = col == self.length[:, None, None]  # [1|G, 1, L] the next column
        ext_tok = torch.where(at_len, s_tok[:, :, None], src_tok)
        ext_lp = torch.where(at_len, s_lp[:, :, None], src_lp)
        dest = torch.where(accept, fin_n + ncount - 1,
                           torch.where(fill, fin_after[:, None] + kcount - 1, self.F))  # [G, N]
        self._write_finished(dest, torch.where(fill[:, :, None], ext_tok, src_tok),
                             torch.where(fill[:, :, None], ext_lp, src_lp),
                             self.length[:, None] + fill.long(), s_score,
                             torch.where(accept, s_lp, float("nan")))
        self.fin_n = fin_after + fill.long().sum(1)

        # next beams: slot b takes the (b+1)-th kept candidate (groups going on only)
        go = kept & ~done[:, None]
        slot = torch.where(go, kcount - 1, B)  # [G, N] B: nowhere
        parents = torch.full((G, B + 1), -1, dtype=torch.int64, device=dev)
        parents.scatter_(1, slot, torch.where(go, s_src, -1))
        new_tok = torch.zeros(G, B + 1, dtype=torch.int64, device=dev).scatter_(
            1, slot, torch.where(go, s_tok, 0))
        new_sum = torch.zeros(G, B + 1, dtype=torch.float64, device=dev).scatter_(
            1, slot, torch.where(go, s_score, 0.0))
        new_lp = torch.zeros(G, B + 1, dtype=torch.float64, device=dev).scatter_(
            1, slot, torch.where(go, s_lp, 0.0))
        parents, new_tok, new_sum, new_lp = (x[:, :B] for x in (parents, new_tok, new_sum,
                                                                 new_lp))
        going = active & ~done  # [G]
        src = parents.clamp(min=0)[:, :, None].expand(G, B, L)
        moved_tok = torch.where(at_len, new_tok[:, :, None], self.tokens.gather(1, src))
        moved_lp = torch.where(at_len, new_lp[:, :, None], self.logprobs.gather(1, src))
        g3 = going[:, None, None]
        self.tokens = torch.where(g3, moved_tok, self.tokens)
        self.logprobs = torch.where(g3, moved_lp, self.logprobs)
        self.sums = torch.where(going[:, None], new_sum, self.sums)
        self.live = torch.where(going[:, None], parents >= 0, self.live & ~done[:, None])
        self.length = self.length + going.long()
        self.done = self.done | done
        return BeamChoice(parents, new_tok, self.done)

    def _write_finished(self, dest: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor,
                        length: torch.Tensor, score: torch.Tensor, stop_lp: torch.Tensor
                        ) -> None:
        """Scatter candidates into the finished buffer at ``dest`` [G, N] (``F``: none)."""
        G, F, L = self.G, self.F, self.L
        d3 = dest[:, :, None].expand(G, -1, L)

        def put(buf: torch.Tensor, val: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            pad = torch.cat([buf, buf[:, :1]], 1)  # [G, F + 1, ...] last: a sink
            return pad.scatter(1, idx, val)[:, :F]

        self.fin_tokens = put(self.fin_tokens, tok, d3)
        self.fin_logprobs = put(self.fin_logprobs, lp, d3)
        self.fin_len = put(self.fin_len, length, dest)
        self.fin_sum = put(self.fin_sum, score, dest)
        self.fin_stop = put(self.fin_stop, stop_lp, dest)

    def finished(self, g: int) -> list[Finished]:
        """Group ``g``'s finished sequences, in the host's order (reads the host once)."""
        n = int(self.fin_n[g])
        lens = self.fin_len[g, :n].tolist()
        toks, lps = self.fin_tokens[g, :n].tolist(), self.fin_logprobs[g, :n].tolist()
        sums, stops = self.fin_sum[g, :n].tolist(), self.fin_stop[g, :n].tolist()
        return [Finished(t[:k], p[:k], s, None if st != st else st)
                for t, p, k, s, st in zip(toks, lps, lens, sums, stops, strict=True)]
