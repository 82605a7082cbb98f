"""Engine stage timings carried in each output (``GenerateOutput.timing``): queue wait,
prefill and decode, consistent with the order things happened; none for a request aborted
before admission."""

from __future__ import annotations

import time

import torch

from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine


def _request(i: int, tokens: int) -> GenerateRequest:
    g = torch.Generator().manual_seed(i)
    return GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                           SamplingParams(max_new_tokens=tokens, ignore_eos=True))


def test_outputs_carry_ordered_stage_times(random_whisper):
    engine = build_engine(model=str(random_whisper), max_running_requests=2)
    requests = [_request(i, 6) for i in range(4)]
    started = time.perf_counter()
    outs = engine.generate(requests)
    wall = time.perf_counter() - started
    for out in outs:
        t = out.timing
        assert t is not None and len(out.token_ids) == 6
        assert t.queue_wait >= 0 and t.prefill > 0 and t.decode > 0
        assert t.queue_wait + t.prefill + t.decode <= wall
    # two rows: the last two requests waited for the first two to finish
    first, last = outs[0].timing, outs[3].timing
    assert last.queue_wait > first.prefill + first.decode * 0.5
    # one token: no decode steps after the prefill's token
    (one,) = engine.generate([_request(9, 1)])
    assert one.timing.decode < one.timing.prefill


def test_aborted_before_admission_has_no_timing(random_whisper):
    engine = build_engine(model=str(random_whisper), max_running_requests=1)
    outs = {}
    reqs = [_request(i, 3) for i in range(2)]
    for r in reqs:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None)
    engine.abort(reqs[1].rid)
    while engine.has_work():
        engine.step()
    assert outs[reqs[1].rid].finish_reason == FinishReason.ABORT
    assert outs[reqs[1].rid].timing is None
    assert outs[reqs[0].rid].timing is not None


def test_a_mixed_step_keeps_the_decode_rows_first_token_time(random_whisper):
    """A mixed step commits new rows' first tokens beside running rows' next ones: only the
    new rows' first-token time is stamped (stamping every row grew a running row's prefill
    time, and shrank its decode time, by every later mixed step it took part in)."""
    engine = build_engine(model=str(random_whisper), max_running_requests=4, mixed_steps=True,
                          overlap_schedule="off")
    modes = []
    schedule = engine.scheduler.schedule

    def watched():
        sched = schedule()
        modes.append(None if sched is None else (sched.mode, sched.num_decode))
        return sched

    engine.scheduler.schedule = watched
    first = _request(0, 8)
    engine.add_request(first)
    engine.step()  # its prefill
    engine.step()  # a decode step
    (req,) = engine.scheduler.running
    stamped = req.first_token_at
    assert stamped is not None
    engine.add_request(_request(1, 3))
    engine.step()  # the first request decodes beside the second's prefill
    assert modes[-1] == (ForwardMode.EXTEND, 1)  # a mixed step
    assert req.first_token_at == stamped
    new = next(r for r in engine.scheduler.running if r is not req)
    assert new.first_token_at > stamped
