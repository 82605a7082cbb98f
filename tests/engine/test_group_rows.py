"""Rows of a row group are explicit: a fork names what the child takes, each best_of row draws
from its own random stream (a function of the request's seed and the row's index), groups are
keyed by a counter id."""

from __future__ import annotations

import dataclasses

import torch

from edserve.engine.finisher import Finisher
from edserve.engine.groups import row_seed
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

PROMPT = [50257, 50362]


def _mel(seed: int = 3) -> torch.Tensor:
    return torch.randn(80, 3000, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_row_seed_is_deterministic_and_distinct():
    assert row_seed(7, 0) == 7  # a one-row request samples as before
    rows = [row_seed(7, k) for k in range(16)]
    assert rows == [row_seed(7, k) for k in range(16)]
    assert len(set(rows)) == 16
    assert row_seed(1, 1) != row_seed(2, 0) and row_seed(1, 1) != 2  # no seed + k overlap
    assert all(0 <= row_seed(s, k) < 2 ** 63 for s in (0, -1, 2 ** 64 - 1) for k in (1, 15))


def _samples(random_whisper, monkeypatch, best_of: int, neighbours: int = 0
             ) -> list[list[int]]:
    """Every sample of one seeded best_of request, in row order (all rows end by length)."""
    seen: list[list[list[int]]] = []
    finish = Finisher.finish_group

    def spy(self, group, reason, error=None):
        seen.append([f.tokens for f in group.finished])
        return finish(self, group, reason, error)

    monkeypatch.setattr(Finisher, "finish_group", spy)
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=16,
                    debug_checks=True)
    sp = SamplingParams(temperature=1.0, best_of=best_of, seed=11, max_new_tokens=6,
                        ignore_eos=True)
    reqs = [GenerateRequest(PROMPT, _mel(), sp)]
    reqs += [GenerateRequest(PROMPT, _mel(5 + i), dataclasses.replace(sp, seed=100 + i))
             for i in range(neighbours)]
    outs = engine.generate(reqs)
    assert all(o.error is None for o in outs)
    assert engine.pools.allocator.num_used() == 0
    return seen[0]


def test_best_of_row_streams_do_not_depend_on_siblings(random_whisper, monkeypatch):
    four = _samples(random_whisper, monkeypatch, 4)
    assert len(four) == 4 and all(len(s) == 6 for s in four)
    assert len({tuple(s) for s in four}) > 1  # rows draw from different streams
    # Rows 0 and 1 are the same samples when rows 2 and 3 do not exist (are dropped) ...
    assert _samples(random_whisper, monkeypatch, 2) == four[:2]
    # ... and when other seeded groups share the batch.
    assert _samples(random_whisper, monkeypatch, 4, neighbours=2) == four


def test_fork_names_every_field(random_whisper):
    engine = build_engine(model=str(random_whisper), page_size="16", max_running_requests=8)
    req = engine.make_req(GenerateRequest(PROMPT, _mel(), SamplingParams(
        temperature=1.0, best_of=3, seed=4, max_new_tokens=5)))
    assert req.group is not None and req.group.generators[0] is req.generator
    req.on_delta, req.kv_len, req.steps, req.req_pool_idx = print, 3, 2, 5
    req.output_ids, req.reserved_slots = [9], 64
    gen = req.group.generators[2]
    child = req.fork(gen)
    assert child.serial != req.serial and child.group is req.group
    assert child.generator is gen and child.on_delta is None and child.req_pool_idx is None
    assert (child.kv_len, child.steps, child.reserved_slots, child.output_ids) == (3, 2, 0, [])
    assert child.cow_pending and child.encoder_input is None and child.request is req.request
    other = engine.make_req(GenerateRequest(PROMPT, _mel(), SamplingParams(beam_size=2)))
    assert other.group.id != req.group.id
