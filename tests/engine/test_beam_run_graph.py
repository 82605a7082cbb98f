"""BeamRunGraphs' plumbing on the CPU: a shape runs eagerly first, is "captured" at its second
occurrence and replayed after that from static input buffers (the packed plan and the
candidates copied in). The recorder here runs the captured body eagerly at each replay, so the
tokens must equal those of plain device beams and of host beams; the CUDA capture itself runs
in tests/engine/test_gpu_beam.py."""

from __future__ import annotations

import types

import pytest

from edserve.engine.beam_run_graph import BeamRunGraphs
from edserve.runtime import build_engine
from tests.engine.test_beam_rows import _requests, _run


class EagerRecordGraphs(BeamRunGraphs):
    @staticmethod
    def _record(body, device):
        return types.SimpleNamespace(replay=body)


def _engine(model, on: bool, page_size: str, strategy: str, max_graphs: int = 8):
    e = build_engine(model=str(model), device="cpu", page_size=page_size, encoder_kv=strategy,
                     max_running_requests=16, debug_checks=True, beam_on_device=on,
                     overlap_schedule="on" if on else "off")
    if on:
        e.scheduler.beams.graphs = EagerRecordGraphs(max_graphs)
    return e


@pytest.mark.parametrize("strategy,page_size,max_graphs", [
    ("flat", "16", 8), ("aligned", "1", 8), ("flat", "4", 1)])
def test_replayed_steps_equal_host_beams(random_whisper, strategy, page_size, max_graphs):
    host = _run(_engine(random_whisper, False, page_size, strategy), _requests())
    eng = _engine(random_whisper, True, page_size, strategy, max_graphs)
    device = _run(eng, _requests())
    graphs = eng.scheduler.beams.graphs
    assert graphs.captures >= 1 and graphs.replays >= 3  # the replay path ran
    assert len(graphs._graphs) <= max_graphs
    for h, d in zip(host, device, strict=True):
        assert d.error is None
        assert d.token_ids == h.token_ids and d.finish_reason == h.finish_reason
        assert d.logprobs == pytest.approx(h.logprobs, abs=1e-4)


def test_new_shape_runs_eagerly_once_then_is_captured(random_whisper):
    eng = _engine(random_whisper, True, "16", "flat")
    graphs = eng.scheduler.beams.graphs
    calls = []
    apply = eng.scheduler.beams.apply
    eng.scheduler.beams.apply = lambda *a, **k: calls.append(k.get("captured", False)) \
        or apply(*a, **k)
    _run(eng, _requests()[2:3])  # one beam-5 request: one shape for most steps
    assert calls[0] is False  # the first step of a shape: eager
    assert graphs.captures >= 1
    # every replay ran the captured body; eager runs happen only for first-seen shapes
    assert calls.count(True) == graphs.replays
    assert calls.count(False) == len(graphs._seen)


class FailingGraphs(BeamRunGraphs):
    @staticmethod
    def _record(body, device):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager_steps(random_whisper, caplog):
    host = _run(_engine(random_whisper, False, "16", "flat"), _requests())
    eng = _engine(random_whisper, True, "16", "flat")
    eng.scheduler.beams.graphs = graphs = FailingGraphs()
    with caplog.at_level("WARNING", logger="edserve"):
        device = _run(eng, _requests())
    assert graphs.broken and graphs.captures == 0 and graphs.replays == 0
    assert any("capturing a beam step failed" in r.message for r in caplog.records)
    for h, d in zip(host, device, strict=True):
        assert d.error is None and d.token_ids == h.token_ids


def test_kv_copies_watched_by_other_ranks_stay_eager(random_whisper):
    eng = _engine(random_whisper, True, "16", "flat")
    seen = []
    eng.pools.kv_pool.copy_observers.append(lambda src, dst: seen.append(src.numel()))
    _run(eng, _requests()[2:3])
    graphs = eng.scheduler.beams.graphs
    assert graphs.captures == 0 and graphs.replays == 0 and seen  # every copy was heard
