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
        if sched.mode == ForwardMode.DECODE and graphs is not None and graphs.can_run(batch):
            logits = graphs.replay(batch, input_ids)
            picked = graphs.sample(sched.sampling, self.history, batch.batch_size)
        elif prompts is not None and prompts.accepts(batch):
            if encoder_states is not None:  # the cross K/V into the pool, then the prompts
                self.model.write_cross_kv(encoder_states, batch)
            picks = self._no_speech_picks(sched)
            out = prompts.run(batch, input_ids, [(i, pos) for i, pos, _ in picks])
            logits = out.logits
            if picks:
                no_speech = self._no_speech_probs(picks, out.picked, len(reqs))
        else:
            batch.attn_backend.init_forward_metadata(batch)
            hidden = self.model(input_ids, batch.positions, batch, encoder_states)  # [T, d]
            last = batch.cu_q[1:].long() - 1  # [B] index of each request's last new token
            logits = self.model.compute_logits(hidden[last])  # [B, V]
            if sched.mode == ForwardMode.EXTEND:
                no_speech = self._no_speech(hidden, sched)
        tokens, logprobs, cands = picked or sample(logits, sched.sampling, self.history, rows)
        done = None
        if sched.beams is not None:  # device beam groups choose and move their rows
            done = sched.beams.beams.run(sched.beams, *cands, sched.sampling.candidates.topk,
                                         self.history)
        return StepOutput(tokens, logprobs, no_speech, cands, done).start_copy()

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

    def _no_speech_picks(self, sched: ScheduledBatch) -> list[tuple[int, int, int]]:
        """``(row, position within its prompt, no-speech token)`` of the new rows that ask for
        Whisper's no-speech probability."""
        return [(i, r.request.no_speech_pos, r.request.no_speech_token)
                for i, r in enumerate(sched.reqs)
                if sched.is_new(i) and r.request.no_speech_pos is not None
                and r.request.no_speech_token is not None]

    def _no_speech(self, hidden: torch.Tensor, sched: ScheduledBatch) -> torch.Tensor | None:
        """[B] softmax(logits at each new request's ``no_speech_pos``)[no_speech_token]; NaN
        for rows that do not ask or are decoding (Whisper's no-speech probability)."""
        picks = self._no_speech_picks(sched)
        if not picks:
            return None
        starts = sched.batch.q_starts_cpu
        pos = to_device([starts[i] + p for i, p, _ in picks], torch.int64, hidden.device)
        return self._no_speech_probs(picks, self.model.compute_logits(hidden[pos]),
                                     len(sched.reqs))

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
