"""Where a step's time went on the device: :class:`StepClock` (CUDA only).

The host's view of a step (``Engine.step``'s wall seconds) mixes its own work with waiting for
the step before it. The clock adds the device's view, from CUDA events read once the step's
results are on the host (no extra sync):

- ``device``: from the step's first launch reaching the device to its results' copy done
  (what the device spent on it, including any launch gaps inside it);
- ``gap``: the device idle before the step began, when the step was launched while the one
  before it was still in flight (overlap scheduling): the host came late, so the device ran
  dry. A step launched with nothing in flight (the engine's first, or one after a synced
  update) counts no gap: part of that wait is the loop having had nothing to do;
- ``wait``: host seconds blocked on the step's results (:meth:`StepOutput.fetch`).

Two events per step (the results' copy records the second anyway), read after that copy's own
event has completed: no host<->device sync of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepMarks:
    """A launched step's events: ``started`` before its first launch; ``after``: the previous
    step's end when it was still in flight at this launch (else None: no gap counted)."""

    started: torch.cuda.Event
    after: torch.cuda.Event | None


class StepClock:
    """Marks steps as they launch and reads the marks once their results are fetched."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._last_end: torch.cuda.Event | None = None

    def begin(self, in_flight: bool) -> StepMarks | None:
        """Before a step's first launch on the current stream; ``in_flight``: the previous
        step's results are not fetched yet (its device work may still be running)."""
        if not self.enabled:
            return None
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        return StepMarks(started, self._last_end if in_flight else None)

    def launched(self, end: torch.cuda.Event | None) -> None:
        """The step just launched ends at ``end`` (its results' copy event)."""
        self._last_end = end

    @staticmethod
    def read(marks: StepMarks | None, end: torch.cuda.Event | None) -> tuple[float, float]:
        """``(device seconds, gap seconds)`` of a step whose ``end`` has completed (0s
        without marks)."""
        if marks is None or end is None:
            return 0.0, 0.0
        device = marks.started.elapsed_time(end) / 1000
        gap = marks.after.elapsed_time(marks.started) / 1000 if marks.after is not None else 0.0
        return device, max(gap, 0.0)
