"""The steps' device view (edserve.engine.step_clock): per kind of step, the host's wait for
the results, the device's seconds and its idle time before overlapped launches, summed in the
step counters and exported on ``/metrics`` beside the wall seconds."""

from __future__ import annotations

import pytest
import torch

from edserve.bench.report import _steps, step_delta
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.engine.step_clock import StepClock
from edserve.engine.step_stats import StepCounters, StepTotals, sum_steps
from edserve.runtime import build_engine
from edserve.server.metrics import step_metrics

PROMPT = [50257, 50362]


def _requests(n: int, device: str = "cpu") -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(3)
    return [GenerateRequest(PROMPT, (torch.randn(80, 3000, generator=gen) * 0.5).to(device),
                            SamplingParams(max_new_tokens=3 + i, ignore_eos=True))
            for i in range(n)]


def test_totals_add_every_field_and_device_times_join_their_kind():
    c = StepCounters()
    c.record("decode", 4, 0, 0.010)
    c.record_device("decode", 0.002, 0.006, 0.001)
    c.record_device("mixed", 0.0, 0.020, 0.0)
    snap = c.snapshot()
    assert snap["decode"] == StepTotals(1, 4, 0, 0.010, 0.002, 0.006, 0.001)
    assert snap["mixed"].device_seconds == 0.020 and snap["mixed"].steps == 0
    both = sum_steps([snap, snap])["decode"]
    assert both == StepTotals(2, 8, 0, 0.020, 0.004, 0.012, 0.002)


def test_metrics_carry_the_device_view_and_the_report_reads_it_per_step():
    steps = {"decode": StepTotals(10, 40, 0, 0.050, 0.010, 0.020, 0.005),
             "idle": StepTotals(seconds=0.5)}
    families = list(step_metrics(steps))
    names = {f.name for f in families}
    assert {"edserve_engine_step_wait_seconds", "edserve_engine_step_device_seconds",
            "edserve_engine_step_gap_seconds"} <= names
    assert all(s.name.endswith("_total") for f in families for s in f.samples)  # counters
    parsed = _steps(families)
    assert parsed["decode"]["device_seconds"] == pytest.approx(0.020)
    d = step_delta({}, parsed, wall=1.0)["decode"]
    assert d["ms_per_step"] == pytest.approx(5.0)
    assert d["device_ms_per_step"] == pytest.approx(2.0)
    assert d["gap_ms_per_step"] == pytest.approx(0.5)
    assert d["wait_ms_per_step"] == pytest.approx(1.0)


def test_off_cuda_the_clock_is_off_and_counts_nothing(random_whisper):
    assert StepClock(torch.device("cpu")).begin(in_flight=True) is None
    assert StepClock.read(None, None) == (0.0, 0.0)
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=4,
                          overlap_schedule="on")
    engine.generate(_requests(3))
    snap = engine.step_counters.snapshot()
    assert snap["prefill"].steps >= 1 and snap["decode"].steps >= 1
    for kind in ("prefill", "decode", "mixed"):
        assert snap[kind].device_seconds == snap[kind].gap_seconds == 0.0
        assert snap[kind].wait_seconds == 0.0  # CPU results need no wait


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_on_cuda_steps_have_device_times_and_gaps_only_when_overlapped(random_whisper, overlap):
    engine = build_engine(model=str(random_whisper), device="cuda", page_size="16",
                          max_running_requests=4, overlap_schedule=overlap)
    engine.generate(_requests(4, "cuda"))
    snap = engine.step_counters.snapshot()
    for kind in ("prefill", "decode"):
        t = snap[kind]
        assert t.steps >= 1 and 0 < t.device_seconds and t.wait_seconds >= 0
        assert t.gap_seconds >= 0
    if overlap == "off":  # nothing in flight at any launch: no gap is attributed
        assert all(snap[k].gap_seconds == 0 for k in ("prefill", "decode", "mixed"))
