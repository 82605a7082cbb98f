"""Row groups in the engine (beam search, best_of): KV sharing, back-pressure, abort, overlap,
and that greedy requests batched with groups are unaffected. Oracle equality of the beams
themselves is in tests/whisper/test_beam_reference.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from edserve.engine.beam_search import BeamGroup
from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.engine.row_group import StepResult
from edserve.runtime import build_engine

PROMPT = [50257, 50362]
EOT = 50256


def _mels(n: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(n)]


def _run_checked(engine: Engine, reqs: list[GenerateRequest]):
    """generate(), with the integrity check after every step."""
    outs = {}
    for r in reqs:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0
    return [outs[r.rid] for r in reqs]


class _Ops:
    """Records a group's row operations (no engine)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.serial = 100

    def advance(self, req, token):
        self.log.append(("advance", req.serial, token))

    def fork(self, source, token):
        self.serial += 1
        self.log.append(("fork", source.serial, token))
        return SimpleNamespace(serial=self.serial)

    def drop(self, req):
        self.log.append(("drop", req.serial))


def test_beam_update_collapses_ranks_and_drops_before_forking():
    leader = SimpleNamespace(serial=1)
    g = BeamGroup(leader, 2, frozenset({EOT}), None, None)
    ops = _Ops()
    # step 1: one row (the prefill); EOT ranks first and is collected as finished
    assert not g.update({1: StepResult(7, -0.1, [(EOT, -0.1), (7, -0.2), (8, -0.3)])},
                        False, ops)
    assert ops.log == [("advance", 1, 7), ("fork", 1, 8)]
    assert [f.tokens for f in g.finished] == [[]]
    a, b = g.members
    # step 2: both continuations come from row a: b is dropped first, then a forks
    ops.log.clear()
    done = g.update({a.serial: StepResult(0, 0, [(5, -0.1), (6, -0.2), (9, -5.0)]),
                     b.serial: StepResult(0, 0, [(5, -3.0), (6, -3.1), (9, -3.2)])},
                    False, ops)
    assert not done
    assert ops.log == [("drop", b.serial), ("advance", a.serial, 5), ("fork", a.serial, 6)]
    assert [g.hyps[m.serial].tokens for m in g.members] == [[7, 5], [7, 6]]
    # step 3: EOT from both: the finished list (2 = beam_size) fills, the group is done
    ops.log.clear()
    m0, m1 = g.members
    assert g.update({m0.serial: StepResult(0, 0, [(EOT, -0.05), (1, -9.0), (2, -9.0)]),
                     m1.serial: StepResult(0, 0, [(EOT, -0.06), (1, -9.0), (2, -9.0)])},
                    False, ops)
    assert [f.tokens for f in g.finished] == [[], [7, 5]]
    assert {op[0] for op in ops.log} == {"drop"}
    best = g.result()  # length-normalised: [] has no length, so its raw sum counts
    assert best.tokens in ([], [7, 5])


@pytest.mark.parametrize("strategy,page_size", [("flat", "128"), ("aligned", "16"),
                                                 ("ragged", "1")])
def test_greedy_unchanged_next_to_groups(random_whisper, strategy, page_size):
    mels = _mels(3)
    greedy = [GenerateRequest(PROMPT, m, SamplingParams(max_new_tokens=10)) for m in mels]
    alone = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                   max_running_requests=16, debug_checks=True)
    base = [o.token_ids for o in alone.generate(greedy)]
    engine = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                    max_running_requests=16, debug_checks=True)
    mixed = [GenerateRequest(PROMPT, m, SamplingParams(max_new_tokens=10)) for m in mels]
    mixed += [GenerateRequest(PROMPT, mels[0], SamplingParams(beam_size=3, max_new_tokens=10)),
              GenerateRequest(PROMPT, mels[1], SamplingParams(temperature=0.7, best_of=3,
                                                               seed=1, max_new_tokens=10))]
    outs = _run_checked(engine, mixed)
    assert [o.token_ids for o in outs[:3]] == base
    assert all(o.error is None for o in outs)
    assert engine.runner.num_encoded_inputs == 5  # one encoder pass per request, not per row


def test_overlap_on_matches_off_with_groups(random_whisper):
    def run(mode):
        e = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                   overlap_schedule=mode)
        reqs = [GenerateRequest(PROMPT, m, SamplingParams(beam_size=2, max_new_tokens=8))
                for m in _mels(2)]
        reqs += [GenerateRequest(PROMPT, m, SamplingParams(max_new_tokens=6 + i))
                 for i, m in enumerate(_mels(2, seed=9))]
        return [(o.token_ids, o.logprobs) for o in _run_checked(e, reqs)]

    assert run("on") == run("off")


def test_groups_wait_for_kv_instead_of_failing(random_whisper):
    """A pool with room for about one beam group at a time: the others queue, all finish."""
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                    max_total_tokens=2200, debug_checks=True)
    reqs = [GenerateRequest(PROMPT, m, SamplingParams(beam_size=4, max_new_tokens=12))
            for m in _mels(3)]
    assert all(r <= engine.pools.allocator.size for r in
               [engine.make_req(x).reserved_slots for x in reqs])
    outs = _run_checked(engine, reqs)
    assert all(o.error is None and o.token_ids for o in outs)


def test_abort_group_midway_frees_everything(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                    debug_checks=True)
    req = GenerateRequest(PROMPT, _mels(1)[0], SamplingParams(beam_size=4, max_new_tokens=40,
                                                              ignore_eos=True))
    got = []
    engine.add_request(req, lambda d: got.append(d) if d.finished else None)
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    assert len(engine.scheduler.running) > 1  # the beams hold rows
    engine.abort(req.rid)
    engine.step()
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0 and not engine.scheduler.running
    assert len(got) == 1 and got[0].output.finish_reason.value == "abort"


@pytest.mark.parametrize("on_device", [False, True])
def test_ending_a_finished_group_again_is_a_no_op(random_whisper, on_device):
    """A failed overlapped step may list rows of a group that finished at the step before: the
    group is not ended (nor reported) a second time."""
    from edserve.engine.request import FinishReason

    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                          debug_checks=True, beam_on_device=on_device,
                          overlap_schedule="on" if on_device else "off")
    req = GenerateRequest(PROMPT, _mels(1)[0], SamplingParams(beam_size=3, max_new_tokens=6,
                                                              ignore_eos=True))
    got, groups = [], []
    engine.add_request(req, lambda d: got.append(d) if d.finished else None)
    while engine.has_work():
        engine.step()
        groups += [r.group for r in engine.scheduler.running if r.group is not None]
    assert len(got) == 1 and groups and groups[0].leader is None  # reported, unlinked
    engine.scheduler._end_group(groups[0], FinishReason.ERROR, "a later step failed")
    engine.check_integrity()
    assert len(got) == 1 and got[0].output.finish_reason.value == "length"
    assert engine.pools.allocator.num_used() == 0


def test_keep_encoder_reuse_and_release(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="128", encoder_kv="flat",
                    max_running_requests=8, debug_checks=True)
    mel = _mels(1)[0]
    fresh = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=8))])[0]
    first = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=8),
                                             keep_encoder=True)])[0]
    handle = first.encoder_kv
    assert handle is not None and first.token_ids == fresh.token_ids
    engine.check_integrity()
    assert engine.pools.allocator.num_used() >= 1500  # the encoder region stays
    encoded = engine.runner.num_encoded_inputs
    retries = engine.generate([
        GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=8), encoder_kv=handle),
        GenerateRequest(PROMPT, mel, SamplingParams(beam_size=3, max_new_tokens=8),
                        encoder_kv=handle),
        # no log-mel: the handle gives the encoder extent (a plain row and a beam group)
        GenerateRequest(PROMPT, None, SamplingParams(max_new_tokens=8), encoder_kv=handle),
        GenerateRequest(PROMPT, None, SamplingParams(beam_size=3, max_new_tokens=8),
                        encoder_kv=handle)])
    assert engine.runner.num_encoded_inputs == encoded  # no encoder pass for reusers
    assert retries[0].token_ids == fresh.token_ids
    assert [r.token_ids for r in retries[2:]] == [r.token_ids for r in retries[:2]]
    engine.check_integrity()
    engine.release_encoder(handle)
    engine.step()  # the release is carried out on the engine thread
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0


def test_group_settings_are_validated(random_whisper):
    for bad in (dict(beam_size=0), dict(beam_size=17), dict(best_of=2),
                dict(beam_size=2, temperature=0.5), dict(patience=2.0),
                dict(beam_size=2, length_penalty=-1.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    engine = build_engine(model=str(random_whisper), max_running_requests=2)
    kept = engine.generate([GenerateRequest(PROMPT, _mels(1)[0], SamplingParams(
        max_new_tokens=2), keep_encoder=True)])[0].encoder_kv
    wrong = dataclasses.replace(kept, encoder_len=10, enc_region=10)
    with pytest.raises(ValueError, match="encoder_kv holds 10 encoder tokens"):
        engine.make_req(GenerateRequest(PROMPT, _mels(1)[0], encoder_kv=wrong))
    engine.release_encoder(kept)
    engine.step()
    assert engine.pools.allocator.num_used() == 0


@pytest.mark.parametrize("strategy,page_size", [("flat", "128"), ("flat", "16"),
                                                ("aligned", "16"), ("ragged", "1")])
def test_kept_encoder_frees_without_a_host_read(random_whisper, monkeypatch, strategy,
                                                page_size):
    """A row that computed its own encoder and keeps it: the row's free and the later release
    read nothing from the device (every page's fate is known on the host); the counts are
    verified by the allocator's debug checks and the integrity check. While a reuser runs,
    the release falls back to the read, and nothing leaks either way."""
    import edserve.mem_cache.allocator as allocator_module

    reads = []
    real = allocator_module.pages_at_zero
    monkeypatch.setattr(allocator_module, "pages_at_zero",
                        lambda *a: reads.append(1) or real(*a))
    engine = build_engine(model=str(random_whisper), page_size=page_size, encoder_kv=strategy,
                          max_running_requests=4, debug_checks=True)
    mel = _mels(1, seed=5)[0]
    out = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=5),
                                           keep_encoder=True)])
    handle = out[0].encoder_kv
    assert handle is not None and handle.exclusive and reads == []
    engine.check_integrity()
    reuse = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=5),
                                             encoder_kv=handle)])[0]
    assert reuse.token_ids == out[0].token_ids
    reads_after_reuse = len(reads)  # the reuser's own row free (shared pages) reads once
    engine.release_encoder(handle)
    engine.step()
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0
    assert len(reads) == reads_after_reuse  # the release of the last holder read nothing
    # released while a reuser still runs: not the last holder, so the read path
    kept = engine.generate([GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=5),
                                            keep_encoder=True)])[0].encoder_kv
    engine.add_request(GenerateRequest(PROMPT, mel, SamplingParams(max_new_tokens=5),
                                       encoder_kv=kept))
    engine.step()
    engine.release_encoder(kept)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0
    assert len(reads) > reads_after_reuse
