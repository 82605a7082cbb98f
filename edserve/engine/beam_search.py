"""Beam search with openai-whisper's semantics, as a :class:`~edserve.engine.row_group.RowGroup`.

Per step, every live beam offers its ``beam_size + 1`` most likely next tokens (log-softmax of
the filtered logits, the same filters as greedy decoding); a candidate scores the beam's sum
log-probability plus the token's. Candidates are keyed by their whole token sequence (equal
sequences collapse, so the single prefilled row stands for openai-whisper's ``beam_size``
identical initial beams). In descending score order, a candidate ending in a stop token joins
the finished list (while it holds fewer than ``round(beam_size * patience)``); the others become
the next beams until ``beam_size`` are kept. The group is done when the finished list is full or
the length limit is reached; then, if fewer than ``beam_size`` sequences finished, the live
beams fill it (best first), and the best by sum log-probability / length penalty wins.

Rows follow the beams: a beam kept by one continuation keeps its row; a beam with several
continuations forks new rows (shared KV, copy-on-write); a beam with none is dropped.
"""

from __future__ import annotations

from edserve.engine.row_group import (
    Candidates,
    Finished,
    GroupOps,
    Hypothesis,
    Row,
    RowGroup,
    StepResult,
)


class BeamGroup(RowGroup):
    def __init__(self, leader: Row, beam_size: int, stop_ids: frozenset[int],
                 length_penalty: float | None, patience: float | None) -> None:
        super().__init__(leader, beam_size, stop_ids, length_penalty)
        self.max_candidates = round(beam_size * (patience or 1.0))
        if self.max_candidates < 1:
            raise ValueError(f"beam_size * patience must round to >= 1, got "
                             f"{beam_size} * {patience}")

    def candidates(self, req: Row, first_step: bool) -> Candidates:
        return Candidates(topk=self.size + 1)

    def update(self, results: dict[int, StepResult], at_limit: bool, ops: GroupOps) -> bool:
        scores: dict[tuple[int, ...], float] = {}
        sources: dict[tuple[int, ...], tuple[Row, int, float]] = {}
        for m in self.members:  # member order is openai-whisper's beam order (ties)
            hyp = self.hyps[m.serial]
            prefix = tuple(hyp.tokens)
            for tok, lp in results[m.serial].candidates[:self.size + 1]:
                if lp == float("-inf"):  # not a choice (a filter forced this step)
                    continue
                seq = prefix + (tok,)
                scores[seq] = hyp.sum_logprob + lp
                sources[seq] = (m, tok, lp)
        kept: list[tuple[int, ...]] = []
        newly: list[tuple[int, ...]] = []
        for seq in sorted(scores, key=scores.__getitem__, reverse=True):
            if seq[-1] in self.stop_ids:
                newly.append(seq)
            else:
                kept.append(seq)
                if len(kept) == self.size:
                    break
        for seq in newly:  # already best first
            if len(self.finished) >= self.max_candidates:
                break
            src, _, lp = sources[seq]
            hyp = self.hyps[src.serial]
            self.finished.append(Finished(list(hyp.tokens), list(hyp.logprobs), scores[seq], lp))
        if len(self.finished) >= self.max_candidates or at_limit or not kept:
            for seq in kept:  # live beams fill the list when too few finished (best first)
                if len(self.finished) >= self.size:
                    break
                src, tok, lp = sources[seq]
                hyp = self.hyps[src.serial].extended(tok, lp)
                self.finished.append(Finished(hyp.tokens, hyp.logprobs, hyp.sum_logprob, None))
            self._drop_all(ops)
            return True
        self._rearrange(kept, sources, ops)
        return False

    def _rearrange(self, kept: list[tuple[int, ...]],
                   sources: dict[tuple[int, ...], tuple[Row, int, float]], ops: GroupOps) -> None:
        """Rows follow the kept beams: drop unused sources first, then advance or fork."""
        used = {sources[seq][0].serial for seq in kept}
        for m in self.members:
            if m.serial not in used:
                ops.drop(m)
        members: list[Row] = []
        hyps: dict[int, Hypothesis] = {}
        continued: set[int] = set()
        for seq in kept:
            src, tok, lp = sources[seq]
            hyp = self.hyps[src.serial].extended(tok, lp)
            if src.serial in continued:
                row = ops.fork(src, tok)
            else:
                continued.add(src.serial)
                ops.advance(src, tok)
                row = src
            members.append(row)
            hyps[row.serial] = hyp
        self.members, self.hyps = members, hyps
