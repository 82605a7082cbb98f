"""Runs one scheduled batch: encoder (prefill only, batched), decoder, logits, sampling.

``run`` only launches device work: input ids of a decode step come from the previous step's
sampled tokens in :class:`~edserve.engine.token_history.TokenHistory` (device), and the results
leave as a :class:`~edserve.engine.step.StepOutput` whose host copy is fetched later.
"""

from __future__ import annotations

import torch

from edserve.engine.cpu_compile import CompiledDecodeRunner
from edserve.engine.cuda_graph import DecodeGraphRunner
from edserve.engine.host_copy import to_device
from edserve.engine.prompt_check import CheckScorer, PromptCheck
from edserve.engine.req import Req
from edserve.engine.sampler import sample
from edserve.engine.step import ScheduledBatch, StepOutput
from edserve.engine.token_history import TokenHistory
from edserve.layers.forward_batch import ForwardMode


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, history: TokenHistory,
                 graph_runner: DecodeGraphRunner | CompiledDecodeRunner | None = None
                 ) -> None:
        self.model = model
        self.device = device
        self.history = history
        self.graph_runner = graph_runner
        self.num_encoder_runs = 0  # encoder forward passes (one per prefill batch with audio)
        self.num_encoded_inputs = 0  # encoder inputs encoded (reused encoder KV: not counted)
        self.check_scorer = CheckScorer()  # prompt checks' choices, uploaded once

    @torch.inference_mode()
    def run(self, sched: ScheduledBatch) -> StepOutput:
        """Forward ``sched`` and sample one token per request (device-side; no sync)."""
        batch, reqs = sched.batch, sched.reqs
        rows = batch.req_pool_indices  # [B] int64
        no_speech = None
        if sched.history_edits is not None:  # row groups rearranged at the last update
            self.history.apply(sched.history_edits, self.device)
        if sched.mode == ForwardMode.EXTEND:  # new rows; a mixed step's decode rows first
            nd = sched.num_decode
            self.history.reset(rows[nd:])
            input_ids = sched.prompt_ids if nd == 0 else torch.cat(
                [self.history.last(rows[:nd]), sched.prompt_ids])  # [T]
            encoder_states = self._encode(reqs[nd:])
        else:
            input_ids = self.history.last(rows)  # [B] the tokens sampled last step
            encoder_states = None
        graphs = self.graph_runner
        prompts = getattr(graphs, "prompts", None)
        picked = None  # (tokens, logprobs, None) from a sampling graph
        ns_at, check_at = self._prompt_picks(sched)  # (row, prompt position, what)
        at = ns_at + check_at
        at_logits = None  # [len(at), V] logits at those positions
        if sched.mode == ForwardMode.DECODE and graphs is not None \
                and graphs.can_run(batch, sched.sampling):
            logits, picked = graphs.step(batch, input_ids, sched.sampling, self.history)
        elif prompts is not None and prompts.accepts(batch):
            if encoder_states is not None:  # the cross K/V into the pool, then the prompts
                self.model.write_cross_kv(encoder_states, batch)
            out = prompts.run(batch, input_ids, [(i, pos) for i, pos, _ in at])
            logits, at_logits = out.logits, out.picked
        else:
            batch.attn_backend.init_forward_metadata(batch)
            hidden = self.model(input_ids, batch.positions, batch, encoder_states)  # [T, d]
            last = batch.cu_q[1:].long() - 1  # [B] index of each request's last new token
            logits = self.model.compute_logits(hidden[last])  # [B, V]
            if at:
                starts = batch.q_starts_cpu
                pos = to_device([starts[i] + p for i, p, _ in at], torch.int64, hidden.device)
                at_logits = self.model.compute_logits(hidden[pos])
        no_speech = checks = None
        n = len(ns_at)
        if ns_at:
            no_speech = self._no_speech_probs(ns_at, at_logits[:n], len(reqs))
        if check_at:
            checks = self._checks(check_at, at_logits[n:], len(reqs))
        tokens, logprobs, cands = picked or sample(logits, sched.sampling, self.history, rows)
        done = None
        if sched.beams is not None:  # device beam groups choose and move their rows
            done = sched.beams.beams.run(sched.beams, *cands, sched.sampling.candidates.topk,
                                         self.history)
        return StepOutput(tokens, logprobs, no_speech, cands, done, checks).start_copy()

    def _encode(self, reqs: list[Req]) -> torch.Tensor | None:
        with_enc = [r for r in reqs if r.encoder_len > 0 and r.request.encoder_kv is None]
        if not with_enc:
            return None
        self.num_encoder_runs += 1
        self.num_encoded_inputs += len(with_enc)
        states = self.model.encode([r.encoder_input for r in with_enc])
        for r, s in zip(with_enc, states, strict=True):
            if s.shape[0] != r.encoder_len:
                raise RuntimeError(f"encoder produced {s.shape[0]} states, expected "
                                   f"{r.encoder_len}")
            r.encoder_input = None  # encoded once; the cross K/V now live in the pool
        return torch.cat(states)

    def _prompt_picks(self, sched: ScheduledBatch
                      ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, PromptCheck]]]:
        """``(row, position within its prompt, what)`` of the new rows whose prompt logits are
        read: those asking for Whisper's no-speech probability (``what``: the no-speech
        token), and those with a prompt check (``what``: the :class:`PromptCheck`). Empty for
        decode steps."""
        if sched.mode != ForwardMode.EXTEND:
            return [], []
        new = [(i, r.request) for i, r in enumerate(sched.reqs) if sched.is_new(i)]
        return ([(i, q.no_speech_pos, q.no_speech_token) for i, q in new
                 if q.no_speech_pos is not None and q.no_speech_token is not None],
                [(i, q.prompt_check.at, q.prompt_check) for i, q in new
                 if q.prompt_check is not None])

    def _checks(self, picks: list[tuple[int, int, PromptCheck]], logits: torch.Tensor,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] chosen tokens (-1 at rows without a check) and [B] their log-probs."""
        dev = logits.device
        tok, lp = self.check_scorer.score(logits, [c for _, _, c in picks])
        which = to_device([i for i, _, _ in picks], torch.int64, dev)
        tokens = torch.full((batch_size,), -1, dtype=torch.int64, device=dev)
        logprobs = torch.full((batch_size,), float("nan"), device=dev)
        return tokens.index_copy_(0, which, tok), logprobs.index_copy_(0, which, lp)

    def _no_speech_probs(self, picks: list[tuple[int, int, int]], logits: torch.Tensor,
                         batch_size: int) -> torch.Tensor:
        """[B] probabilities of the picks' tokens under ``logits`` ``[len(picks), V]``, NaN
        at the other rows."""
        dev = logits.device
        which, tok = (to_device(c, torch.int64, dev) for c in zip(*[(i, t) for i, _, t in picks],
                                                                  strict=True))
        probs = torch.softmax(logits.float(), dim=-1)  # [k, V]
        out = torch.full((batch_size,), float("nan"), device=dev)
        return out.index_copy_(0, which, probs.gather(1, tok[:, None])[:, 0])
