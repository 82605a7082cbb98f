"""What the engine's steps did, as running totals: :class:`StepCounters`.

A server under load is bound either by its engine or by what feeds it; these counters say which
from ``/metrics`` alone: per kind of step (``decode``: running rows only; ``prefill``: newly
admitted rows only; ``mixed``: both in one forward) the steps taken, the rows they carried, the
rows admitted and the wall seconds spent in ``Engine.step`` (with overlap scheduling that
includes waiting for the previous step's tokens, so it tracks device time when the device is
the bound); and the seconds the engine loop slept with no work (``idle``, added when the loop
wakes: an interval that starts while the loop sleeps also counts that sleep's earlier part, so
short intervals overstate it). What a run spends in neither is the loop's own overhead (hooks,
calls, waiting for the GIL). Rates over an
interval give steps/s, rows per step and new rows per prefill (how well arrivals are batched).

On CUDA each kind also sums the device's view (:mod:`edserve.engine.step_clock`): its seconds
on the device, the device's idle seconds before such steps (the host came late) and the host's
seconds blocked on their results. A step's host work is its wall seconds less that wait.

Host numbers plus two CUDA events per step, read after the step's own results: no device reads
of their own.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field

STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True)
class StepTotals:
    """Totals of one kind of step since the engine started."""

    steps: int = 0
    rows: int = 0  # rows carried (running + admitted), summed over steps
    new_rows: int = 0  # rows admitted (prefilling), summed over steps
    seconds: float = 0.0  # wall seconds inside Engine.step
    wait_seconds: float = 0.0  # host seconds blocked on these steps' results (fetch)
    device_seconds: float = 0.0  # device seconds of these steps (CUDA; 0 elsewhere)
    gap_seconds: float = 0.0  # device idle before these steps while the previous was in flight

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class StepCounters:
    """Mutable totals, updated on the engine thread only; :meth:`snapshot` for other threads."""

    totals: dict[str, StepTotals] = field(
        default_factory=lambda: {k: StepTotals() for k in STEP_KINDS})
    idle_seconds: float = 0.0  # the engine loop asleep with no work (added by the loop)

    def record(self, kind: str, rows: int, new_rows: int, seconds: float) -> None:
        self.totals[kind] += StepTotals(1, rows, new_rows, seconds)

    def record_device(self, kind: str, wait: float, device: float, gap: float) -> None:
        """A fetched step's host wait and device times (:class:`~edserve.engine.step_clock.
        StepClock`), added to its kind."""
        self.totals[kind] += StepTotals(wait_seconds=wait, device_seconds=device,
                                        gap_seconds=gap)

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
            out[kind] = out.get(kind, StepTotals()) + t
    return out
