"""The one-launch beam choice (:mod:`edserve.kernels.beam_choice`, Triton interpreter on CPU)
against the tensor-op version it replaces (``beam_choices.choose_by_ops``, itself checked
against the host's openai-whisper beam search in tests/engine/test_beam_device.py): after every
step of a random replay the outputs and *every* state tensor must be equal bit for bit,
including dead slots, the finished buffer and the token histories, at state widths 3 and 16 (the
engine's), beams 1..8, patience, several stop tokens, length limits and filtered candidates. On
a machine with CUDA the same tests run the compiled kernel."""

from __future__ import annotations

import pytest
import torch
from beam_candidates import candidates

from edserve.engine.beam_device import BeamBatch
from edserve.kernels import beam_choice

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (conftest)


def _state_equal(a: BeamBatch, b: BeamBatch) -> None:
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        if x.is_floating_point():  # NaN marks "no stop log-prob": compare it as a value
            x, y = x.nan_to_num(nan=7.0), y.nan_to_num(nan=7.0)
        assert torch.equal(x, y), name


def _replay(seed: int, G: int, width: int, max_beam: int, L: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    beams = torch.randint(1, max_beam + 1, (G,), generator=gen).tolist()
    states = [BeamBatch(G + 1, width, L, DEV, c) for c in ("ops", "triton")]
    for g, b in enumerate(beams):
        patience = [None, 0.5, 1.0, 2.0][g % 4]
        patience = patience if patience is None or round(b * patience) >= 1 else None
        stops = [frozenset({0}), frozenset({0, 3}), frozenset(), frozenset({1, 2, 3, 4})][g % 4]
        for st in states:
            st.admit(g, b, patience, stops)
    limits = torch.randint(1, L, (G + 1,), generator=gen).tolist()
    for step in range(1, L + 1):
        toks, lps = (x.to(DEV) for x in candidates(gen, G + 1, width, width + 1, 3 * width + 10))
        at_limit = torch.tensor([step >= n for n in limits], device=DEV)
        ops, kern = (st.step(toks.clone(), lps.clone(), at_limit.clone()) for st in states)
        assert torch.equal(ops.parents, kern.parents), f"step {step}"
        assert torch.equal(ops.tokens, kern.tokens), f"step {step}"
        assert torch.equal(ops.lead, kern.lead), f"step {step}"
        assert kern.done is states[1].done
        _state_equal(*states)
        if bool(states[0].done[:G].all()):
            return step
    return L


@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_the_tensor_ops_at_the_engines_width(seed):
    assert _replay(seed, G=5, width=16, max_beam=8, L=30 if seed == 0 else 12) >= 1


@pytest.mark.parametrize("seed", range(3))
def test_kernel_equals_the_tensor_ops_at_a_small_width(seed):
    assert _replay(100 + seed, G=4, width=3, max_beam=3, L=14) >= 1


def test_groups_wider_than_the_kernel_take_the_tensor_ops():
    st = BeamBatch(2, 10, 6, DEV, "triton")
    st.admit(0, 9, None, frozenset({0}))
    assert st.width == 9 and not beam_choice.fits(st.width)
    assert st.shape_key()[:2] == ("triton", 9)
    gen = torch.Generator().manual_seed(0)
    toks, lps = (x.to(DEV) for x in candidates(gen, 2, 10, 11, 40))
    ref = BeamBatch(2, 10, 6, DEV, "ops")
    ref.admit(0, 9, None, frozenset({0}))
    no = torch.zeros(2, dtype=torch.bool, device=DEV)
    a, b = st.step(toks, lps, no), ref.step(toks, lps, no)
    assert torch.equal(a.parents, b.parents) and torch.equal(a.tokens, b.tokens)
    _state_equal(st, ref)


def test_bad_inputs_are_refused():
    st = BeamBatch(2, 3, 6, DEV, "triton")
    st.admit(0, 3, None, frozenset({0}))
    toks = torch.zeros(2, 3, 4, dtype=torch.int64, device=DEV)
    lps = torch.zeros(2, 3, 4, device=DEV)
    no = torch.zeros(2, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match=r"T > 3"):  # too few places for beam 3
        beam_choice.beam_choice(st.tensors(), 3, toks[:, :, :3], lps[:, :, :3], no)
    with pytest.raises(ValueError, match="one layout"):
        beam_choice.beam_choice(st.tensors(), 3, toks,
                                lps.transpose(1, 2).contiguous().transpose(1, 2), no)
    with pytest.raises(ValueError, match="unknown beam choice"):
        BeamBatch(2, 3, 6, choice="fast")


def test_without_cuda_or_the_interpreter_it_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        BeamBatch(2, 3, 6, choice="triton")
    assert BeamBatch(2, 3, 6).choice == "ops"  # the default off CUDA
