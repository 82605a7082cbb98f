"""Device-side beam choice (:mod:`edserve.engine.beam_device`) against the host's
:class:`~edserve.engine.beam_search.BeamGroup` (itself checked against openai-whisper's rules in
tests/whisper/test_beam_reference.py): random steps replayed through both, many groups at once,
beam sizes 1..5, ties, patience, length penalties, several stop tokens, filtered candidates and
length limits; the live beams, their sums, the finished lists, the done flags and the chosen
sequence must be equal after every step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from beam_candidates import candidates as _candidates
from cuda_syncs import count_syncs

from edserve.engine.beam_device import BeamBatch
from edserve.engine.beam_graph import make_beam_stepper
from edserve.engine.beam_search import BeamGroup
from edserve.engine.row_group import StepResult, best


class _Ops:
    """Row operations of the host groups: forks get fresh serials."""

    def __init__(self) -> None:
        self.serial = 0

    def advance(self, req, token):
        pass

    def fork(self, source, token, generator=None):
        self.serial += 1
        return SimpleNamespace(serial=self.serial)

    def drop(self, req):
        pass


def _replay(seed: int, G: int, device: str = "cpu", stepper: str = "eager",
            choice: str | None = None) -> int:
    """Replay random steps through both (the device side through the engine's stepper
    interface: ``stepper`` names it; ``choice``: BeamBatch's); returns the steps taken (all
    asserts inside)."""
    gen = torch.Generator().manual_seed(seed)
    beams = torch.randint(1, 6, (G,), generator=gen).tolist()
    patience = [None if torch.rand(1, generator=gen) < 0.5 else
                [0.5, 1.0, 1.5, 2.0][int(torch.randint(0, 4, (1,), generator=gen))]
                for _ in range(G)]
    patience = [p if p is None or round(b * p) >= 1 else None
                for b, p in zip(beams, patience, strict=True)]
    vocab = 10
    stops = [[frozenset({0}), frozenset({0, 3}), frozenset()][g % 3] for g in range(G)]
    limits = torch.randint(1, 14, (G,), generator=gen).tolist()
    hosts = [BeamGroup(SimpleNamespace(serial=-1 - g), b, s, None, p)
             for g, (b, s, p) in enumerate(zip(beams, stops, patience, strict=True))]
    ops = _Ops()
    B, T = max(beams), max(beams) + 1
    dev = BeamBatch(G + 1, B, max(limits) + 1, device=device, choice=choice)  # one free
    for g in range(G):
        dev.admit(g, beams[g], patience[g], stops[g])
    run = make_beam_stepper(dev, T, stepper)
    done = [False] * G
    step = 0
    while not all(done):
        step += 1
        toks, lps = _candidates(gen, G + 1, B, T, vocab)
        at_limit = [step >= n for n in limits]
        for g, h in enumerate(hosts):
            if done[g]:
                continue
            res = {m.serial: StepResult(0, 0.0, list(zip(toks[g, b].tolist(),
                                                         lps[g, b].tolist(), strict=True)))
                   for b, m in enumerate(h.members)}
            done[g] = h.update(res, at_limit[g], ops)
        slots = dev.rank_slot.cpu()  # the device reads candidates per slot (row)
        toks = torch.zeros_like(toks).scatter_(1, slots[:, :, None].expand_as(toks), toks)
        lps = torch.zeros_like(lps).scatter_(1, slots[:, :, None].expand_as(lps), lps)
        ct, cl, lim = run.inputs()
        ct.copy_(toks)
        cl.copy_(lps)
        lim.copy_(torch.tensor(at_limit + [False]))
        choice = run.step()
        assert choice.done.tolist() == done + [True], f"step {step}"
        assert not dev.live[G].any() and int(dev.fin_n[G]) == 0  # the free slot
        for g, h in enumerate(hosts):
            live = dev.live[g].nonzero().flatten().tolist()
            if done[g]:
                assert live == []
                fin = dev.finished([g])[0]
                assert fin == h.finished, f"group {g}"
                for penalty in (None, 0.0, 0.6, 1.0):
                    assert best(fin, penalty) == best(h.finished, penalty)
                    # the engine's read: only the chosen one, whole and partial columns
                    assert dev.best([g], [penalty])[0] == best(h.finished, penalty)
                    assert dev.best([g], [penalty], upto=step)[0] == best(h.finished, penalty)
                n = len(best(h.finished, None).tokens)
                if n > 1:  # too few columns for the chosen one: an error, not wrong tokens
                    with pytest.raises(RuntimeError, match="columns"):
                        dev.best([g], [None], upto=n - 1)
                continue
            n = int(dev.length[g])
            ranks = dev.rank_slot[g, :len(h.members)].tolist()  # member order
            assert sorted(ranks) == live, f"group {g} step {step}"
            assert sorted(dev.rank_slot[g].tolist()) == list(range(B))  # a permutation
            assert [dev.tokens[g, b, :n].tolist() for b in ranks] == \
                [h.hyps[m.serial].tokens for m in h.members]
            assert [dev.logprobs[g, b, :n].tolist() for b in ranks] == \
                [h.hyps[m.serial].logprobs for m in h.members]
            assert dev.sums[g, ranks].tolist() == [h.hyps[m.serial].sum_logprob
                                                   for m in h.members]
            assert dev.finished([g])[0] == h.finished
    return step


@pytest.mark.parametrize("seed", range(12))
def test_device_ranking_matches_host_beam_search(seed):
    assert _replay(seed, G=6) >= 1


@pytest.mark.parametrize("seed", range(4))
def test_triton_choice_matches_host_beam_search(seed):
    """The one-launch kernel (Triton interpreter on CPU) against the host groups."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert _replay(seed, G=6, device=dev, choice="triton") >= 1


def test_parents_and_tokens_describe_the_rearrangement():
    """Slot b's new beam is its parent's beam plus its token (the engine's gather plan); a
    beam's first continuation keeps its slot."""
    dev = BeamBatch(1, 2, 4)
    dev.admit(0, 2, None, frozenset({0}))
    toks = torch.tensor([[[5, 6, 0], [1, 2, 3]]])
    c1 = dev.step(toks, torch.tensor([[[-0.1, -0.2, -0.3], [-1.0, -1.0, -1.0]]]),
                  torch.tensor([False]))
    assert c1.parents.tolist() == [[0, 0]] and c1.tokens.tolist() == [[5, 6]]
    # both new beams continue slot 1 (slot 0's candidates rank lower); EOT from slot 1 ranks
    # between them and is collected
    c2 = dev.step(torch.tensor([[[7, 8, 9], [4, 0, 2]]]),
                  torch.tensor([[[-5.0, -5.0, -5.0], [-0.1, -0.2, -0.3]]]),
                  torch.tensor([False]))
    # slot 1's first continuation stays in slot 1, the second takes the free slot 0
    assert c2.parents.tolist() == [[1, 1]] and c2.tokens.tolist() == [[2, 4]]
    assert dev.rank_slot[0].tolist() == [1, 0] and c2.lead.tolist() == [1]
    assert dev.tokens[0, :, :2].tolist() == [[6, 2], [6, 4]]
    assert [f.tokens for f in dev.finished([0])[0]] == [[6]] and not c2.done.item()


def test_bad_settings_are_refused_and_slots_are_reused():
    dev = BeamBatch(2, 3, 4)
    with pytest.raises(ValueError, match="round to >= 1"):
        dev.admit(0, 1, 0.4, frozenset({0}))
    with pytest.raises(ValueError, match="beam_size must be 1..3"):
        dev.admit(0, 4, None, frozenset({0}))
    dev.admit(1, 2, 3.0, frozenset({0, 1, 2}))  # widens the finished buffer and stop table
    assert dev.F == 6 and dev.stop.shape[1] == 3
    toks = torch.tensor([[[0, 1, 2, 3]] * 3] * 2)
    lps = torch.tensor([[[-0.1, -0.2, -0.3, -0.4]] * 3] * 2)
    dev.step(toks, lps, torch.tensor([False, True]))
    assert dev.done.tolist() == [True, True] and len(dev.finished([1])[0]) == 3
    dev.release([1])
    dev.admit(1, 3, None, frozenset({9}))  # a new group starts clean in the same slot
    assert dev.finished([1])[0] == [] and dev.live[1].tolist() == [True, False, False]
    assert dev.best([1], [None]) == [None]  # an empty buffer: nothing chosen
    dev.step(toks, lps, torch.tensor([False, False]))
    assert dev.tokens[1, :, 0].tolist() == [0, 1, 2] and not dev.done[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("choice", ["ops", "triton"])
def test_device_step_matches_and_never_syncs(choice):
    assert _replay(0, G=8, device="cuda", choice=choice) >= 1
    dev = BeamBatch(64, 5, 448, device="cuda", choice=choice)
    for g in range(64):
        dev.admit(g, 5, None, frozenset({0}))
    gen = torch.Generator().manual_seed(1)
    toks, lps = (x.cuda() for x in _candidates(gen, 64, 5, 6, 51865))
    at_limit = torch.zeros(64, dtype=torch.bool, device="cuda")
    dev.step(toks, lps, at_limit)  # warm-up
    assert count_syncs(lambda: dev.step(toks, lps, at_limit)) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_stepper_matches_host_and_recaptures_when_widened():
    """The CUDA-graph replay of the choice equals the host groups (the same random replay as
    on the CPU), and a group admitted mid-run that widens the finished buffer and the stop
    table makes the graph capture again, after which it still equals the eager steps."""
    assert _replay(3, G=8, device="cuda", stepper="graph") >= 1
    G, B, L = 6, 4, 12
    states = [BeamBatch(G, B, L, device="cuda") for _ in range(2)]
    runs = [make_beam_stepper(st, B + 1, name)
            for st, name in zip(states, ("eager", "graph"), strict=True)]
    gen = torch.Generator().manual_seed(7)
    for st in states:
        for g in range(3):
            st.admit(g, 3, None, frozenset({0}))
    for step in range(8):
        if step == 3:  # F 4 -> 8, stop table 1 -> 2 columns
            for st in states:
                st.admit(4, 4, 2.0, frozenset({0, 3}))
        toks, lps = _candidates(gen, G, B, B + 1, 10)
        choices = []
        for run in runs:
            ct, cl, lim = run.inputs()
            ct.copy_(toks)
            cl.copy_(lps)
            lim[4] = step >= 6  # the widened group reaches its length limit
            choices.append(run.step())
        for a, b in zip(*(vars(c).values() for c in choices), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}")
        for k, t in states[0].tensors().items():  # fin_stop: NaN marks a length-limit finish
            torch.testing.assert_close(t, states[1].tensors()[k], rtol=0, atol=0,
                                       equal_nan=True, msg=f"{k} at step {step}")
    # captured at construction (widest beam 1), after the first admits (3), after the
    # widening admit (4 wide, F 4 -> 8, two stop tokens)
    assert runs[1].captures == (3 if states[1].choice == "triton" else 2)
    ct, cl, lim = runs[1].inputs()
    ct.copy_(toks)
    cl.copy_(lps)
    assert count_syncs(runs[1].step) == 0
