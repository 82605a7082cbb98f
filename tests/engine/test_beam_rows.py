"""Beam search on fixed rows with the choice on the device (``beam_on_device``): the same
tokens as the host's beam search next to greedy and best_of requests, steps that never read a
device value on the host (so beam batches overlap), abort, and KV integrity after every step.
The openai-whisper oracle runs both ways in tests/whisper/test_beam_reference.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from host_reads import host_reads_counted, host_reads_raise

from edserve.engine.logits_filter import FilterContext, LogitsFilter
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

PROMPT = [50257, 50362]
EOT = 50256


@dataclass(frozen=True)
class EotBias(LogitsFilter):
    """Random weights hardly end: a bias on end-of-text makes beams finish at varied steps."""

    bias: float

    def apply(self, logits: torch.Tensor, ctx: FilterContext) -> None:
        logits[:, EOT] += self.bias


def _mels(n: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(n)]


def _requests() -> list[GenerateRequest]:
    m = _mels(4)
    beam = [GenerateRequest(PROMPT, m[i], SamplingParams(beam_size=b, max_new_tokens=n,
                                                         patience=p),
                            logits_processors=[EotBias(e)] if e else [])
            for i, (b, n, p, e) in enumerate([(3, 10, None, 0.0), (2, 14, 2.0, 5.5),
                                              (5, 9, None, 6.0)])]
    return beam + [GenerateRequest(PROMPT, m[3], SamplingParams(max_new_tokens=8)),
                   GenerateRequest(PROMPT, m[0], SamplingParams(temperature=0.7, best_of=2,
                                                                seed=3, max_new_tokens=6))]


def _run(engine, reqs, check=None):
    outs = {}
    for r in reqs:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        if check is not None:
            check(engine)
    assert engine.pools.allocator.num_used() == 0
    return [outs[r.rid] for r in reqs]


@pytest.mark.parametrize("strategy,page_size,kernel", [
    ("flat", "128", False), ("aligned", "16", True), ("ragged", "1", False), ("flat", "64", True)])
def test_device_beams_equal_host_beams(random_whisper, strategy, page_size, kernel):
    """``kernel``: the device engine copies K/V through the Triton pair-copy kernel and
    chooses beams by the Triton beam-choice kernel, as on CUDA (its attention stays torch's)."""
    def engine(on):
        e = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                         max_running_requests=16, debug_checks=True, beam_on_device=on,
                         overlap_schedule="on" if on else "off",
                         beam_choice="triton" if on and kernel else "auto")
        assert e.scheduler.beams is None or e.scheduler.beams.state.choice == \
            ("triton" if kernel or e.device.type == "cuda" else "ops")
        e.pools.kv_pool.copy_kernel = on and kernel
        return e

    host = _run(engine(False), _requests())
    device = _run(engine(True), _requests())
    assert {o.finish_reason.value for o in host[:3]} == {"stop", "length"}  # both endings
    for h, d in zip(host, device, strict=True):
        assert d.error is None
        assert d.token_ids == h.token_ids and d.finish_reason == h.finish_reason
        assert d.logprobs == pytest.approx(h.logprobs, abs=1e-4)
        assert (d.stop_logprob is None) == (h.stop_logprob is None)


def test_beam_steps_overlap_and_read_nothing_from_the_device(random_whisper, monkeypatch):
    """With device beams no step asks for a synchronous update, and scheduling + launching a
    step (prefill, mixed, decode) reads no device value on the host: the host learns the done
    flags from the step's one copy."""
    engine = build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                          max_running_requests=16, debug_checks=False, beam_on_device=True,
                          overlap_schedule="on")
    engine.pools.kv_pool.check_indices = False  # as on CUDA (a CPU-only bounds check)
    reqs = _requests()[:4]  # beams and greedy (best_of still chooses on the host)
    outs = {}
    for r in reqs[:2]:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None)
    engine._drain_inbox()
    steps = 0
    while engine.scheduler.has_work() or engine._in_flight is not None:
        if steps == 3:  # arrivals while beams decode: a mixed step
            for r in reqs[2:]:
                engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output)
                                   if d.finished else None)
            engine._drain_inbox()
        previous, engine._in_flight = engine._in_flight, None
        with host_reads_raise(monkeypatch, engine.pools.backend):
            sched = engine.scheduler.schedule()
            output = engine.runner.run(sched) if sched is not None else None
        if sched is not None:
            assert not sched.sync_update
            engine._in_flight = (sched, output)
        if previous is not None:
            engine.scheduler.update(*previous)
        steps += 1
    assert len(outs) == len(reqs) and all(o.error is None for o in outs.values())
    engine.check_integrity()


def test_abort_device_group_midway_frees_everything(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                          debug_checks=True, beam_on_device=True, overlap_schedule="on")
    req = GenerateRequest(PROMPT, _mels(1)[0], SamplingParams(beam_size=4, max_new_tokens=40,
                                                              ignore_eos=True))
    got = []
    engine.add_request(req, lambda d: got.append(d) if d.finished else None)
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    assert len(engine.scheduler.running) == 4  # the group's fixed rows
    engine.abort(req.rid)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0 and not engine.scheduler.running
    assert len(got) == 1 and got[0].output.finish_reason.value == "abort"
    again = engine.generate([GenerateRequest(PROMPT, _mels(1)[0], SamplingParams(
        beam_size=4, max_new_tokens=5))])[0]  # the group slot is reused
    assert again.error is None and len(again.token_ids) == 5


def _sync_test_requests(engine, device: str = "cpu") -> None:
    """Greedy rows and beam groups of 4 that end at different steps (forced lengths)."""
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        mel = (torch.randn(80, 3000, generator=gen) * 0.5).to(device)
        sp = SamplingParams(max_new_tokens=20 + 3 * i, ignore_eos=True,
                            beam_size=4 if i % 2 else 1)
        engine.add_request(GenerateRequest(PROMPT, mel, sp))


def _drain(engine) -> None:
    """Run the engine dry (a failed assertion must not leave requests behind)."""
    while engine.has_work():
        engine.step()


# A step where device beam groups end reads the host twice: the step's results copy (done
# flags included) and the ended groups' best finished sequences (BeamBatch.best, one read for
# all); their rows and encoder holds free without a read (DeviceBeams.release,
# release_encoder(last_holder=True)).
END_STEP_READS = 2


def test_device_beam_steps_read_the_host_once_and_twice_when_groups_end(random_whisper,
                                                                       monkeypatch):
    """Every engine step (schedule, launch, the previous step's update) reads the host once,
    and twice when beam groups end (counted on CPU where CUDA would sync)."""
    engine = build_engine(model=str(random_whisper), page_size="128", encoder_kv="flat",
                          max_running_requests=32, debug_checks=False, beam_on_device=True,
                          overlap_schedule="on")
    engine.pools.kv_pool.check_indices = False  # as on CUDA (a CPU-only bounds check)
    _sync_test_requests(engine)
    ended, per_step = 0, []
    try:
        while engine.has_work():
            free_slots = len(engine.scheduler.beams._free)
            with host_reads_counted(monkeypatch, engine.pools.backend) as sites:
                engine.step()
            groups_ended = len(engine.scheduler.beams._free) > free_slots
            ended += groups_ended
            per_step.append((sum(sites.values()), groups_ended, dict(sites)))
    finally:
        _drain(engine)
    assert ended == 3  # the three groups (different lengths) end at different steps
    for reads, groups_ended, sites in per_step[1:]:  # step 0 launches only (overlap)
        assert reads == (END_STEP_READS if groups_ended else 1), sites
    engine.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["flat", "aligned"])
def test_beam_decode_steps_sync_once_on_cuda(tmp_path, strategy):
    """On CUDA with graphs: a steady step of beam groups beside greedy rows waits on the
    device once (its results' copy, with overlap one step late); a step where groups end
    also reads their finished sequences (``END_STEP_READS``)."""
    from cuda_syncs import sync_sites
    from whisper_fixtures import make_random_whisper

    folder = make_random_whisper(tmp_path)
    engine = build_engine(model=str(folder), device="cuda", page_size="128",
                          encoder_kv=strategy, max_running_requests=32, debug_checks=False,
                          beam_on_device=True, overlap_schedule="on")
    _sync_test_requests(engine, "cuda")
    try:
        for _ in range(4):
            engine.step()
        steps = 10
        sites = sync_sites(lambda: [engine.step() for _ in range(steps)])
        assert sum(sites.values()) <= steps, f"{dict(sites)} in {steps} steps"
        while engine.has_work():
            sites = sync_sites(engine.step)
            assert sum(sites.values()) <= END_STEP_READS, dict(sites)
    finally:
        _drain(engine)
    engine.check_integrity()


def test_device_beams_reuse_and_keep_encoder_regions(random_whisper):
    """A device beam group on a held encoder region (the fallback's reuse), and one that
    keeps its region: the host beams' tokens, and every page back once the handles go."""
    mel = _mels(1, seed=1)[0]
    tokens = []
    for on in (False, True):
        e = build_engine(model=str(random_whisper), page_size="128", encoder_kv="flat",
                         max_running_requests=8, debug_checks=True, beam_on_device=on)
        held = e.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=4),
                                           keep_encoder=True)])[0].encoder_kv
        outs = e.generate([
            GenerateRequest(PROMPT, mel, SamplingParams(beam_size=3, max_new_tokens=8),
                            encoder_kv=held),
            GenerateRequest(PROMPT, mel, SamplingParams(beam_size=4, max_new_tokens=6),
                            keep_encoder=True)])
        e.check_integrity()
        e.release_encoder(held)
        e.release_encoder(outs[1].encoder_kv)
        e.step()
        e.check_integrity()
        assert e.pools.allocator.num_used() == 0
        tokens.append([o.token_ids for o in outs])
    assert tokens[0] == tokens[1]


def test_reorders_copy_only_the_columns_past_the_shared_tokens(random_whisper, monkeypatch):
    """A moved row copies its parent's K/V only from the first token their sequences do not
    share (the rest is already bit-identical): the same tokens as copying the whole partial
    page, with fewer copied slots."""
    from edserve.engine.beam_rows import DeviceBeams

    def run(whole_tail: bool):
        if whole_tail:
            monkeypatch.setattr(DeviceBeams, "copy_start",
                                staticmethod(lambda plan, parents, history: plan.dec_start))
        e = build_engine(model=str(random_whisper), device="cpu", page_size="128",
                         encoder_kv="flat", max_running_requests=16, debug_checks=True,
                         beam_on_device=True, overlap_schedule="on")
        pool, copied = e.pools.kv_pool, []
        real = pool.copy_slots

        def counting(src, dst):
            copied.append(int((src != dst).sum()))
            real(src, dst)
        pool.copy_slots = counting
        return _run(e, _requests()), sum(copied)

    fewer, n_fewer = run(False)
    whole, n_whole = run(True)
    for a, b in zip(fewer, whole, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert 0 < n_fewer < n_whole


def test_groups_start_and_end_together_in_one_pass_each(random_whisper, monkeypatch):
    """Three beam groups admitted by one prefill step go through one admission (one state
    upload, one fork, one private-tail pass), groups that end in the same step are released
    in one call, and their encoder holds are taken and dropped in one pass each; the beams
    equal the host's and every page comes back."""
    from edserve.engine import beam_rows, group_ops
    from edserve.engine.beam_device import BeamBatch

    calls = {"admit": [], "release": [], "forks": 0, "holds": [], "drops": []}
    admit_many, release = BeamBatch.admit_many, BeamBatch.release
    fork, holds, drops = beam_rows.fork_rows, group_ops.hold_encoders, group_ops.release_encoders
    monkeypatch.setattr(BeamBatch, "admit_many", lambda self, s, *a: calls["admit"].append(
        len(s)) or admit_many(self, s, *a))
    monkeypatch.setattr(BeamBatch, "release", lambda self, s: calls["release"].append(
        len(s)) or release(self, s))
    monkeypatch.setattr(beam_rows, "fork_rows", lambda *a: calls.__setitem__(
        "forks", calls["forks"] + 1) or fork(*a))
    monkeypatch.setattr("edserve.engine.scheduler.hold_encoders", lambda p, r: calls[
        "holds"].append(len(r)) or holds(p, r))
    monkeypatch.setattr("edserve.engine.finisher.release_encoders", lambda p, h, **k: calls[
        "drops"].append(len(h)) or drops(p, h, **k))

    def reqs():
        m = _mels(3, seed=9)
        return [GenerateRequest(PROMPT, m[i], SamplingParams(beam_size=b, max_new_tokens=6,
                                                             ignore_eos=True))
                for i, b in enumerate([3, 2, 4])]

    def engine(on):
        return build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                            max_running_requests=16, debug_checks=True, beam_on_device=on,
                            overlap_schedule="on" if on else "off")

    host = _run(engine(False), reqs())
    calls.update(admit=[], release=[], forks=0, holds=[], drops=[])
    device = _run(engine(True), reqs())
    assert calls["admit"] == [3] and calls["forks"] == 1  # one prefill step, three groups
    assert calls["release"] == [3] and calls["drops"] == [3]  # all end at step 6
    assert calls["holds"] == [3]
    for h, d in zip(host, device, strict=True):
        assert d.error is None and d.token_ids == h.token_ids
