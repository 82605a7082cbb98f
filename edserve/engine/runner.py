"""Runs one batch through the model: encoder (prefill only, batched), decoder, logits, sampling."""

from __future__ import annotations

import torch

from edserve.engine.cuda_graph import DecodeGraphRunner
from edserve.engine.forward_batch import ForwardBatch, ForwardMode
from edserve.engine.req import Req
from edserve.engine.sampler import sample


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device,
                 graph_runner: DecodeGraphRunner | None = None) -> None:
        self.model = model
        self.device = device
        self.graph_runner = graph_runner

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, reqs: list[Req]) -> tuple[list[int], list[float]]:
        """Forward ``batch`` and sample one token per request."""
        dev = self.device
        encoder_states = None
        if batch.mode == ForwardMode.EXTEND:
            input_ids = torch.tensor([t for r in reqs for t in r.prompt_ids], device=dev)
            encoder_states = self._encode(reqs)
        else:
            input_ids = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
            graphs = self.graph_runner
            if graphs is not None and graphs.can_run(batch):
                return sample(graphs.replay(batch, input_ids), reqs)
        batch.attn_backend.init_forward_metadata(batch)
        hidden = self.model(input_ids, batch.positions, batch, encoder_states)  # [T, d]
        last = batch.cu_q[1:].long() - 1  # [B] index of each request's last new token
        logits = self.model.compute_logits(hidden[last])  # [B, V]
        if batch.mode == ForwardMode.EXTEND:
            self._no_speech(hidden, batch, reqs)
        return sample(logits, reqs)

    def _encode(self, reqs: list[Req]) -> torch.Tensor | None:
        with_enc = [r for r in reqs if r.encoder_len > 0]
        if not with_enc:
            return None
        states = self.model.encode([r.encoder_input for r in with_enc])
        for r, s in zip(with_enc, states, strict=True):
            if s.shape[0] != r.encoder_len:
                raise RuntimeError(f"encoder produced {s.shape[0]} states, expected "
                                   f"{r.encoder_len}")
            r.encoder_input = None  # encoded once; the cross K/V now live in the pool
        return torch.cat(states)

    def _no_speech(self, hidden: torch.Tensor, batch: ForwardBatch, reqs: list[Req]) -> None:
        starts = batch.cu_q[:-1].tolist()
        for r, start in zip(reqs, starts, strict=True):
            pos, tok = r.request.no_speech_pos, r.request.no_speech_token
            if pos is None or tok is None:
                continue
            logits = self.model.compute_logits(hidden[start + pos][None]).float()
            r.no_speech_prob = float(torch.softmax(logits, -1)[0, tok])
