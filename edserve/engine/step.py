"""The hand-offs of one engine step: scheduler -> runner (:class:`ScheduledBatch`) and
runner -> scheduler (:class:`StepOutput`).

``Engine.step`` is ``schedule() -> run() -> update()``. With overlap scheduling the runner's
output is fetched one step late: step N+1 is scheduled and launched before step N's tokens
reach the host, so :meth:`StepOutput.fetch` (the step's only device->host wait) overlaps the
host work of the next step with the device work of this one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edserve.engine.req import Req

if TYPE_CHECKING:
    from edserve.engine.beam_rows import BeamStepPlan
from edserve.engine.sampler import SamplingPlan
from edserve.engine.step_clock import StepMarks
from edserve.engine.token_history import HistoryEdits
from edserve.layers.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ScheduledBatch:
    """What the scheduler decided for one step; the runner reads nothing else."""

    mode: ForwardMode  # EXTEND: newly admitted requests' prefill; DECODE: one token each
    reqs: list[Req]  # the batch's requests, in row order of every [B] tensor below
    batch: ForwardBatch  # index tensors (rows, slots, lengths), already on the device
    sampling: SamplingPlan  # filter groups, temperatures, generators of these rows
    prompt_ids: torch.Tensor | None = None  # [T_new] int64 new rows' prompt tokens (EXTEND)
    # EXTEND (a mixed step): the first ``num_decode`` rows are running rows taking their next
    # token (one query each, input = their last sampled token); the rest are newly admitted
    num_decode: int = 0
    history_edits: HistoryEdits | None = None  # row groups' edits from the previous update
    # True when ``update`` must run before the next ``schedule`` (row groups decide on the
    # host which rows continue), so the engine does not overlap this step
    sync_update: bool = False
    beams: BeamStepPlan | None = None  # device beam groups' work after sampling

    def is_new(self, i: int) -> bool:
        """Row ``i`` was admitted by this step (it prefills; EXTEND only)."""
        return self.mode == ForwardMode.EXTEND and i >= self.num_decode


@dataclass
class StepOutput:
    """The sampled tokens of one step: on the device at once, on the host after fetch()."""

    tokens: torch.Tensor  # [B] int64 (device)
    logprobs: torch.Tensor  # [B] float32 (device)
    no_speech: torch.Tensor | None  # [B] float32 (device; NaN where not asked), EXTEND only
    # Row groups' candidates (see SamplingPlan.candidates): ([C] int64, [C] float32) or None
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None
    beam_done: torch.Tensor | None = None  # [capacity] bool device beam groups done
    # prompt checks of new rows: ([B] int64 chosen token, -1 where none; [B] float32 log-prob)
    checks: tuple[torch.Tensor, torch.Tensor] | None = None
    _host: torch.Tensor | None = None  # [2B (+B) (+2B checks) + 2C (+D)] float64 (CUDA: pinned)
    _ready: torch.cuda.Event | None = None  # the results' copy (timed: StepClock reads it)
    marks: StepMarks | None = None  # set by the engine at launch (CUDA)
    waited: float = 0.0  # host seconds fetch() blocked on the device
    _flat: list[float] | None = None  # _host as a list with the NaNs, once fetched

    def start_copy(self) -> StepOutput:
        """Start the device->host copy of the results (non-blocking on CUDA): one packed
        buffer, ``[tokens, logprobs, no_speech (only when asked), checks, candidates, beam
        done]``; :meth:`fetch` puts NaNs where no no-speech probabilities were asked (no fill op
        per step: int8 tiny.en compiled CPU step 2.18 -> 2.14 ms, wave 31)."""
        parts = [self.tokens, self.logprobs]
        if self.no_speech is not None:  # else NaNs put in by fetch
            parts.append(self.no_speech)
        if self.checks is not None:
            parts += list(self.checks)
        if self.candidates is not None:
            parts += list(self.candidates)
        if self.beam_done is not None:
            parts.append(self.beam_done)
        packed = torch.cat([p.double().reshape(-1) for p in parts])
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event(enable_timing=True)
            self._ready.record()
        else:
            self._host = packed
        return self

    @property
    def end_event(self) -> torch.cuda.Event | None:
        """The event of the results' copy (None off CUDA)."""
        return self._ready

    def fetch(self) -> tuple[list[int], list[float], list[float | None]]:
        """(tokens, log-probabilities, no-speech probabilities or None): the step's one sync."""
        if self._ready is not None and self._flat is None:
            t0 = time.perf_counter()
            self._ready.synchronize()
            self.waited = time.perf_counter() - t0
        B = self.tokens.shape[0]
        if self._flat is None:
            self._flat = self._host.tolist()
            if self.no_speech is None:
                self._flat[2 * B:2 * B] = [float("nan")] * B
        tok, lp, ns = (self._flat[i * B:(i + 1) * B] for i in range(3))
        return ([int(t) for t in tok], lp,
                [None if x != x else x for x in ns])  # NaN -> None

    def fetch_checks(self) -> list[tuple[int, float] | None]:
        """Per row, the prompt check's (chosen token, log-prob), or None (after :meth:`fetch`)."""
        B = self.tokens.shape[0]
        if self.checks is None:
            return [None] * B
        tok, lp = self._flat[3 * B:4 * B], self._flat[4 * B:5 * B]
        return [None if t < 0 else (int(t), x) for t, x in zip(tok, lp, strict=True)]

    def fetch_candidates(self) -> tuple[list[int], list[float]]:
        """The candidates' ([C] tokens, [C] log-probs) on the host (after :meth:`fetch`)."""
        flat, B = self._flat, self.tokens.shape[0]
        D = 0 if self.beam_done is None else self.beam_done.numel()
        start = 3 * B if self.checks is None else 5 * B
        C = (len(flat) - start - D) // 2
        return [int(t) for t in flat[start:start + C]], flat[start + C:start + 2 * C]

    def fetch_beam_done(self) -> list[bool]:
        """The device beam groups' done flags (by group slot; after :meth:`fetch`)."""
        D = self.beam_done.numel()
        return [x != 0 for x in self._flat[len(self._flat) - D:]]
