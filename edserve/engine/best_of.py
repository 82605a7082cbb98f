"""best_of sampling (temperature > 0), as a :class:`~edserve.engine.row_group.RowGroup`.

openai-whisper's ``best_of``: ``N`` independent samples of the same window, the best by sum
log-probability over the length penalty. The leader row prefills the encoder and the prompt
once and draws ``N`` first tokens from the prompt's distribution, draw ``k`` from row ``k``'s own
random stream (``generators[k]``); ``N - 1`` forks (shared KV) then continue one sample each,
row ``k`` drawing on from that same stream, so a row's samples depend only on the request's
seed and its index, never on its siblings. A sample ends on a stop token
(counted in its sum log-probability) or at the length limit; the group is done when none is
left.
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


class BestOfGroup(RowGroup):
    _fresh = True  # the prefill step's draws have not been split into rows yet

    def candidates(self, req: Row, first_step: bool) -> Candidates:
        return Candidates(draws=self.size) if first_step else Candidates()

    def update(self, results: dict[int, StepResult], at_limit: bool, ops: GroupOps) -> bool:
        if self._fresh:  # forks first, while the leader's row is surely alive
            self._fresh = False
            leader = self.members[0]
            first = results[leader.serial]
            draws = first.candidates[:self.size] or [(first.token, first.logprob)]
            results = {leader.serial: StepResult(*draws[0], [])}
            for k, (tok, lp) in enumerate(draws[1:], 1):
                if tok in self.stop_ids or at_limit:  # a one-token sample needs no row
                    self._close(Hypothesis(), tok, lp)
                    continue
                child = ops.fork(leader, tok, self.generators[k])  # row k keeps its stream
                self.members.append(child)
                self.hyps[child.serial] = Hypothesis()
                results[child.serial] = StepResult(tok, lp, [])
        alive: list[Row] = []
        for m in self.members:
            r = results[m.serial]
            hyp = self.hyps[m.serial]
            if r.token in self.stop_ids or at_limit:
                self._close(hyp, r.token, r.logprob)
                ops.drop(m)
                continue
            self.hyps[m.serial] = hyp.extended(r.token, r.logprob)
            ops.advance(m, r.token)
            alive.append(m)
        self.members = alive
        return not alive

    def _close(self, hyp: Hypothesis, token: int, logprob: float) -> None:
        """A sample ends: on a stop token (its log-prob counts), or by length (``token`` is
        then its last token)."""
        if token in self.stop_ids:
            self.finished.append(Finished(list(hyp.tokens), list(hyp.logprobs),
                                          hyp.sum_logprob + logprob, logprob))
        else:
            hyp = hyp.extended(token, logprob)
            self.finished.append(Finished(hyp.tokens, hyp.logprobs, hyp.sum_logprob, None))
