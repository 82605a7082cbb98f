"""The hand-offs of one engine step: scheduler -> runner (:class:`ScheduledBatch`) and
runner -> scheduler (:class:`StepOutput`).

``Engine.step`` is ``schedule() -> run() -> update()``. With overlap scheduling the runner's
output is fetched one step late: step N+1 is scheduled and launched before step N's tokens
reach the host, so :meth:`StepOutput.fetch` (the step's only device->host wait) overlaps the
host work of the next step with the device work of this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edserve.engine.forward_batch import ForwardBatch, ForwardMode
from edserve.engine.req import Req
from edserve.engine.sampler import SamplingPlan


@dataclass
class ScheduledBatch:
    """What the scheduler decided for one step; the runner reads nothing else."""

    mode: ForwardMode  # EXTEND: newly admitted requests' prefill; DECODE: one token each
    reqs: list[Req]  # the batch's requests, in row order of every [B] tensor below
    batch: ForwardBatch  # index tensors (rows, slots, lengths), already on the device
    sampling: SamplingPlan  # filter groups, temperatures, generators of these rows
    prompt_ids: torch.Tensor | None = None  # [T] int64 prompt tokens (EXTEND only)


@dataclass
class StepOutput:
    """The sampled tokens of one step: on the device at once, on the host after fetch()."""

    tokens: torch.Tensor  # [B] int64 (device)
    logprobs: torch.Tensor  # [B] float32 (device)
    no_speech: torch.Tensor | None  # [B] float32 (device; NaN where not asked), EXTEND only
    _host: torch.Tensor | None = None  # [3, B] float64 copy (pinned on CUDA)
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> StepOutput:
        """Start the device->host copy of the results (non-blocking on CUDA)."""
        ns = self.no_speech if self.no_speech is not None \
            else torch.full_like(self.logprobs, float("nan"))
        packed = torch.stack([self.tokens.double(), self.logprobs.double(), ns.double()])
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = packed
        return self

    def fetch(self) -> tuple[list[int], list[float], list[float | None]]:
        """(tokens, log-probabilities, no-speech probabilities or None): the step's one sync."""
        if self._ready is not None:
            self._ready.synchronize()
        tok, lp, ns = self._host.tolist()
        return ([int(t) for t in tok], lp,
                [None if x != x else x for x in ns])  # NaN -> None
