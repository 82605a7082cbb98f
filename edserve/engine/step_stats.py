"""What the engine's steps did, as running totals: :class:`StepCounters`.

A server under load is bound either by its engine or by what feeds it; these counters say which
from ``/metrics`` alone: per kind of step (``decode``: running rows only; ``prefill``: newly
admitted rows only; ``mixed``: both in one forward) the steps taken, the rows they carried, the
rows admitted and the wall seconds spent in ``Engine.step``, and the seconds the engine loop
slept with no work (``idle``; what is left of a run is the loop's own overhead: hooks, calls,
waiting for the GIL) (with overlap scheduling that
includes waiting for the previous step's tokens, so it tracks device time when the device is
the bound). Rates over an interval give steps/s, rows per step and new rows per prefill (how
well arrivals are batched); seconds/s near 1 means the engine loop never idles.

Only host integers and one ``perf_counter`` per step: no device reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True)
class StepTotals:
    """Totals of one kind of step since the engine started."""

    steps: int = 0
    rows: int = 0  # rows carried (running + admitted), summed over steps
    new_rows: int = 0  # rows admitted (prefilling), summed over steps
    seconds: float = 0.0  # wall seconds inside Engine.step


@dataclass
class StepCounters:
    """Mutable totals, updated on the engine thread only; :meth:`snapshot` for other threads."""

    totals: dict[str, StepTotals] = field(
        default_factory=lambda: {k: StepTotals() for k in STEP_KINDS})
    idle_seconds: float = 0.0  # the engine loop asleep with no work (added by the loop)

    def record(self, kind: str, rows: int, new_rows: int, seconds: float) -> None:
        t = self.totals[kind]
        self.totals[kind] = StepTotals(t.steps + 1, t.rows + rows, t.new_rows + new_rows,
                                       t.seconds + seconds)

    def snapshot(self) -> dict[str, StepTotals]:
        """The totals by kind, plus ``idle`` (``seconds``: the loop asleep with no work)."""
        return {**self.totals, "idle": StepTotals(seconds=self.idle_seconds)}


def step_kind(num_rows: int, num_new: int) -> str:
    """``decode`` (no admitted row), ``prefill`` (only admitted rows) or ``mixed``."""
    if num_new == 0:
        return "decode"
    return "prefill" if num_new == num_rows else "mixed"


def sum_steps(snapshots: list[dict[str, StepTotals]]) -> dict[str, StepTotals]:
    """Several engines' totals added kind by kind (data-parallel workers)."""
    out: dict[str, StepTotals] = {}
    for snap in snapshots:
        for kind, t in snap.items():
            o = out.get(kind, StepTotals())
            out[kind] = StepTotals(o.steps + t.steps, o.rows + t.rows,
                                   o.new_rows + t.new_rows, o.seconds + t.seconds)
    return out
