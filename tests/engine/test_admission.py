"""Admission batching (``--admission-wait-ms``): while rows decode, arrivals wait until enough
of them share one prefill step (or the wait runs out); outputs equal the unbatched engine's,
the step counters account for every admission, and the KV integrity check passes throughout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edserve.engine.admission import AdmissionPolicy
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

PROMPT = [50257, 50362]


def _waiting(*ages: float, now: float = 100.0) -> list[SimpleNamespace]:
    return [SimpleNamespace(submitted_at=now - a) for a in ages]


def test_policy_holds_only_while_rows_decode_and_the_batch_is_short():
    p = AdmissionPolicy(wait_s=0.02, batch=3)
    assert p.hold(_waiting(0.001), num_running=4, free_rows=10, now=100.0)
    assert not p.hold(_waiting(0.001), num_running=0, free_rows=10, now=100.0)  # idle engine
    assert not p.hold(_waiting(0.03), num_running=4, free_rows=10, now=100.0)  # waited enough
    assert not p.hold(_waiting(0.001, 0.001, 0.001), 4, 10, now=100.0)  # a full batch
    assert not p.hold(_waiting(0.001, 0.001), 4, 2, now=100.0)  # fills every free row
    assert not p.hold([], 4, 10, now=100.0)
    assert not AdmissionPolicy().hold(_waiting(0.0), 4, 10, now=100.0)  # off by default
    with pytest.raises(ValueError):
        AdmissionPolicy(wait_s=-1.0)
    with pytest.raises(ValueError):
        build_engine(model="tiny.en", admission_batch=0)


def _requests(n: int) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(3)
    return [GenerateRequest(PROMPT, torch.randn(80, 3000, generator=gen) * 0.5,
                            SamplingParams(max_new_tokens=6 + i, ignore_eos=True), rid=f"r{i}")
            for i in range(n)]


def _run(engine, reqs, arrivals=None):
    """By default r0 alone; after 2 steps r1; after 2 more r2 and r3 (``arrivals``: step ->
    requests). Returns outputs and, per step, the rids it admitted."""
    outs, admitted = {}, []

    def submit(r):
        engine.add_request(GenerateRequest(r.prompt_ids, r.encoder_input, r.sampling, rid=r.rid),
                           lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None,
                           stream=False)

    arrivals = arrivals or {0: [reqs[0]], 2: [reqs[1]], 4: reqs[2:]}
    step = 0
    while step in arrivals or engine.has_work():
        for r in arrivals.get(step, []):
            submit(r)
        before = {r.rid for r in engine.scheduler.running}
        engine.step()
        engine.check_integrity()
        admitted.append(sorted({r.rid for r in engine.scheduler.running} - before))
        step += 1
    return outs, admitted


def test_arrivals_share_a_prefill_and_outputs_do_not_change(random_whisper):
    reqs = _requests(4)
    runs = {}
    for wait in (0.0, 60_000.0):
        engine = build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                              max_running_requests=8, admission_wait_ms=wait, admission_batch=3)
        runs[wait] = _run(engine, reqs), engine.step_counters.snapshot()
    (plain, plain_adm), plain_steps = runs[0.0]
    (held, held_adm), held_steps = runs[60_000.0]
    assert [a for a in plain_adm if a] == [["r0"], ["r1"], ["r2", "r3"]]
    # held: r1 waits (r0 decodes, the batch of 3 is not full) until r2 and r3 arrive
    assert [a for a in held_adm if a] == [["r0"], ["r1", "r2", "r3"]]
    for r in reqs:
        assert held[r.rid].token_ids == plain[r.rid].token_ids
        assert len(held[r.rid].token_ids) == 6 + int(r.rid[1:])
        assert held[r.rid].finish_reason == plain[r.rid].finish_reason
    for steps, admissions in ((plain_steps, 3), (held_steps, 2)):
        assert sum(t.new_rows for t in steps.values()) == 4
        assert steps["prefill"].steps + steps["mixed"].steps == admissions
        assert steps["decode"].new_rows == 0 and steps["decode"].steps > 0
        assert steps["idle"].steps == 0 and steps["idle"].seconds == 0  # Engine.step only


def test_a_step_with_running_rows_admits_at_most_the_mixed_budget(random_whisper):
    """``--max-mixed-prefill-tokens``: while rows run, a step admits at most that much encoder
    work (here one window: the bound never goes below one request); a step with nothing
    running takes the whole --max-prefill-tokens (a cold start's batch). Tokens unchanged."""
    reqs = _requests(4)
    runs = {}
    for mixed in (None, 1):
        engine = build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                              max_running_requests=8, max_mixed_prefill_tokens=mixed)
        limits = engine.scheduler.limits
        assert (limits.max_mixed_prefill_tokens < limits.max_prefill_tokens) == (mixed == 1)
        runs[mixed] = (_run(engine, reqs),
                       _run(engine, reqs, {0: reqs[:3], 1: [reqs[3]]}))
    (plain, plain_adm), (cold, cold_adm) = runs[None]
    (bound, bound_adm), (bound_cold, bound_cold_adm) = runs[1]
    assert [a for a in plain_adm if a] == [["r0"], ["r1"], ["r2", "r3"]]
    assert [a for a in bound_adm if a] == [["r0"], ["r1"], ["r2"], ["r3"]]
    assert [a for a in cold_adm if a] == [a for a in bound_cold_adm if a] \
        == [["r0", "r1", "r2"], ["r3"]]  # nothing ran at step 0: the full budget
    for r in reqs:
        assert bound[r.rid].token_ids == plain[r.rid].token_ids
        assert bound_cold[r.rid].token_ids == cold[r.rid].token_ids == plain[r.rid].token_ids
    with pytest.raises(ValueError, match="--max-mixed-prefill-tokens"):
        build_engine(model="tiny.en", max_mixed_prefill_tokens=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_mixed_steps_take_four_windows_by_default_with_unchanged_tokens(random_whisper):
    """The CUDA default (four windows while rows run; CUDA graphs on): six arrivals while two
    rows decode are admitted four, then two; the tokens equal an unbounded engine's."""
    reqs = _requests(8)
    arrivals = {0: reqs[:2], 2: reqs[2:]}
    runs = {}
    for mixed in (None, 1 << 20):
        engine = build_engine(model=str(random_whisper), device="cuda", dtype="float32",
                              page_size="16", encoder_kv="flat", max_running_requests=8,
                              max_mixed_prefill_tokens=mixed,
                              max_total_tokens=65536)  # leave the GPU to the other tests
        runs[mixed] = _run(engine, reqs, arrivals), engine.scheduler.limits
    (bound, bound_adm), limits = runs[None]
    (free, free_adm), _ = runs[1 << 20]
    assert limits.max_mixed_prefill_tokens < limits.max_prefill_tokens
    assert [len(a) for a in bound_adm if a] == [2, 4, 2]
    assert [len(a) for a in free_adm if a] == [2, 6]
    for r in reqs:
        assert bound[r.rid].token_ids == free[r.rid].token_ids
