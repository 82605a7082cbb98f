"""Beam choice on the device: :class:`~edserve.engine.beam_search.BeamGroup`'s step as tensor
ops over every beam group of a batch, so the host need only learn which groups are done.

Each group has ``B`` fixed *slots* (rows; the largest beam size): ``rank_slot[g, k]`` is the
slot of the group's ``k``-th beam in the host version's member order (which breaks ties). A
step's result is a parent slot per slot plus its new token, which the engine applies to rows,
page tables and token histories as gathers; a beam's first continuation stays in its slot and
only the others move (a moved row copies its partial last page). Nothing here reads a value on
the host except :meth:`BeamBatch.best` (:meth:`BeamBatch.finished`), called once for the groups
done at a step.

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

import numpy as np
import torch

from edserve.engine.beam_choices import BEAM_CHOICES, BeamChoice, check_choice
from edserve.engine.host_copy import to_device
from edserve.engine.row_group import Finished, rank_score


class BeamBatch:
    """The beam state of up to ``capacity`` groups (see the module doc), one *group slot*
    each: :meth:`admit` starts a group in a slot, :meth:`step` advances every admitted group
    that is not done, :meth:`release` frees the slot. Nothing here waits for the device except
    :meth:`finished`.

    ``choice`` names how :meth:`step` runs (:data:`~edserve.engine.beam_choices.BEAM_CHOICES`):
    ``"ops"``, tensor ops (any device; the reference), or ``"triton"``, one kernel launch (the
    same results bit for bit) while every admitted beam fits it, else the ops. None: Triton on
    CUDA, the ops elsewhere."""

    def __init__(self, capacity: int, max_beam: int, max_tokens: int,
                 device: torch.device | str = "cpu", choice: str | None = None) -> None:
        if capacity < 1 or max_beam < 1 or max_tokens < 1:
            raise ValueError(f"BeamBatch: capacity, max_beam and max_tokens must be >= 1, got "
                             f"{capacity}, {max_beam}, {max_tokens}")
        dev = self.device = torch.device(device)
        self.choice = check_choice(choice or ("triton" if dev.type == "cuda" else "ops"), dev)
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
        self.admit_many([slot], [beam], [patience], [stop_ids])

    def admit_many(self, slots: list[int], beams: list[int], patience: list[float | None],
                   stop_ids: list[frozenset[int]]) -> None:
        """:meth:`admit` for several groups in one upload and one write per state tensor (a
        prefill step admits all its beam requests together; one at a time, each group cost
        ~12 small device writes and an upload)."""
        max_cand = [round(b * (p or 1.0)) for b, p in zip(beams, patience, strict=True)]
        for b, p, m in zip(beams, patience, max_cand, strict=True):
            if not 1 <= b <= self.B or m < 1:
                raise ValueError(f"beam_size must be 1..{self.B} and beam_size * patience "
                                 f"round to >= 1, got {b} * {p}")
        if not slots:
            return
        if max(max_cand) > self.F:
            self._widen(max(max_cand))
        self.width = max(self.width, *beams)
        most = max(len(s) for s in stop_ids)
        if most > self.stop.shape[1]:  # widen the stop table (host-known shape)
            pad = torch.full((self.G, most - self.stop.shape[1]), -1,
                             dtype=torch.int64, device=self.device)
            self.stop = torch.cat([self.stop, pad], 1)
        S, n = self.stop.shape[1], len(slots)
        stops = [t for s in stop_ids for t in sorted(s) + [-1] * (S - len(s))]
        vals = to_device(slots + beams + max_cand + stops, torch.int64, self.device)
        idx = vals[:n]  # [n] group slots
        self.beam[idx], self.max_cand[idx] = vals[n:2 * n], vals[2 * n:3 * n]
        self.stop[idx] = vals[3 * n:].view(n, S)
        first = torch.arange(self.B, device=self.device) == 0  # [B] the prefilled row only
        self.live[idx] = first
        self.sums.index_fill_(0, idx, 0.0)  # index_fill_: no host value copied (see release)
        self.length.index_fill_(0, idx, 0)
        self.rank_slot[idx] = torch.arange(self.B, device=self.device)
        self.fin_n.index_fill_(0, idx, 0)
        self.done.index_fill_(0, idx, False)

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

    def release(self, slots: list[int]) -> None:
        """The groups in ``slots`` are over (finished and read, or aborted)."""
        if slots:
            idx = to_device(slots, torch.int64, self.device)
            # index_fill_, not ``t[idx] = True``: a Python value there goes to the device as a
            # host tensor, a synchronising copy (two syncs a step where groups end, on CUDA)
            self.done.index_fill_(0, idx, True)
            self.live.index_fill_(0, idx, False)

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

    def _packed(self, slots: list[int], upto: int | None) -> tuple[torch.Tensor, int]:
        """[n, 1 + 3F + 2FL] float64 on the device: per group of ``slots`` its buffer's
        entries, lengths, sums, stop log-probs, tokens, log-probs (the integers travel as
        float64, exact below 2**53); and L, the token columns kept."""
        idx = to_device(slots, torch.int64, self.device)
        n = len(slots)
        L = self.L if upto is None else max(1, min(upto, self.L))
        return torch.cat([self.fin_n[idx][:, None].double(), self.fin_len[idx].double(),
                          self.fin_sum[idx], self.fin_stop[idx],
                          self.fin_tokens[idx][:, :, :L].reshape(n, -1).double(),
                          self.fin_logprobs[idx][:, :, :L].reshape(n, -1)], 1), L

    def best(self, slots: list[int], length_penalties: list[float | None],
             upto: int | None = None) -> list[Finished | None]:
        """Each group's highest-ranked finished sequence (:func:`~edserve.engine.row_group.
        best`'s choice: ``rank_score``, first on ties; None for an empty buffer), in one
        host read; only the chosen sequences become Python lists (``upto``: as in
        :meth:`finished`)."""
        packed, L = self._packed(slots, upto)
        host = packed.numpy(force=True)  # [n, 1 + 3F + 2FL] float64: the one host read
        F = self.F
        head = host[:, :1 + 3 * F].tolist()
        toks = host[:, 1 + 3 * F:1 + 3 * F + F * L]
        lps = host[:, 1 + 3 * F + F * L:]
        out: list[Finished | None] = []
        for i, (row, lp) in enumerate(zip(head, length_penalties, strict=True)):
            n = int(row[0])
            if n == 0:
                out.append(None)
                continue
            lens, sums, stops = row[1:1 + n], row[1 + F:1 + F + n], row[1 + 2 * F:1 + 2 * F + n]
            scores = [rank_score(int(k), s, lp) for k, s in zip(lens, sums, strict=True)]
            f = scores.index(max(scores))
            if lens[f] > L:  # the caller's ``upto`` undercounted: never read a neighbour's row
                raise RuntimeError(f"a finished sequence of {int(lens[f])} tokens, read with "
                                   f"only {L} columns (upto={upto})")
            a, b = f * L, f * L + int(lens[f])
            out.append(Finished(toks[i, a:b].astype(np.int64).tolist(), lps[i, a:b].tolist(),
                                sums[f], None if stops[f] != stops[f] else stops[f]))
        return out

    def finished(self, slots: list[int], upto: int | None = None) -> list[list[Finished]]:
        """The finished sequences of the groups in ``slots``, in the host's order (one read
        of the host for all: the integers travel as float64, exact below 2**53). ``upto``:
        no sequence is longer (the host's step count), so only that many token columns are
        read (at 64 groups x 5 x 448 columns the whole buffer is ~2.3 MB of float64)."""
        packed, L = self._packed(slots, upto)
        flat = packed.tolist()
        F = self.F
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
