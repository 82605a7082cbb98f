"""The timestamp-grammar kernel vs :meth:`ApplyTimestampRules.apply_ops` (its tensor-op
reference; CPU: the Triton interpreter): the same logits after the rules, on every history
shape the rules tell apart (nothing sampled, a text token, an open / a closed timestamp pair,
timestamps out of order, a full history), one block and several, with and without the latest
initial timestamp."""

from __future__ import annotations

import pytest
import torch

from edserve.engine.logits_filter import FilterContext
from edserve.kernels.timestamp_rules import apply_timestamp_rules
from edserve.whisper.logits import ApplyTimestampRules

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _histories(tb: int, V: int, C: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows covering each case of the rules (tokens: text < tb - 2, eot = tb - 2, timestamps
    >= tb), plus random rows; history columns past a row's length hold junk."""
    ts = lambda i: tb + i  # noqa: E731
    rows = [
        [],  # first position: a timestamp <= the latest initial one
        [5],  # text
        [ts(3)],  # one timestamp: an open pair
        [ts(3), ts(9)],  # a closed pair: text or end next
        [ts(3), 7, 8],  # text after an opened segment
        [ts(3), 7, ts(12)],  # open pair after text: close it (>= 12) or end
        [ts(30), ts(30), 4],  # after a pair: timestamps > 30
        [ts(40), 4, ts(2)],  # out of order (sampled anyway): the rule reads the last one
        [9] * C,  # a full history
    ]
    for _ in range(7):
        n = int(torch.randint(0, C + 1, (1,), generator=gen))
        toks = torch.where(torch.rand(n, generator=gen) < 0.4,
                           torch.randint(tb, V, (n,), generator=gen),
                           torch.randint(0, tb - 2, (n,), generator=gen))
        rows.append(toks.tolist())
    hist = torch.randint(0, V, (len(rows), C), generator=gen)  # junk past each length
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    for i, r in enumerate(rows):
        hist[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return hist, lens


@pytest.mark.parametrize(("V", "tb", "C", "max_initial"), [
    (300, 200, 12, 50), (300, 200, 12, None), (5000, 4100, 24, 50), (2600, 2100, 9, 3)])
@pytest.mark.parametrize("ts_scale", [-6.0, 4.0])
def test_kernel_equals_the_tensor_ops(V, tb, C, max_initial, ts_scale):
    """``ts_scale`` lowers or lifts the timestamp logits, so the last rule ("timestamps
    together likelier than any text token") fires on few rows or on most; rows whose two sides
    are within 1e-4 of each other (where float sums in another order may decide either way)
    are left out of the comparison."""
    gen = torch.Generator().manual_seed(V + C)
    hist, lens = _histories(tb, V, C, gen)
    R = hist.shape[0]
    logits = torch.randn(R, V, generator=gen) * 3
    logits[:, tb:] += ts_scale
    rules = ApplyTimestampRules(eot=tb - 2, no_timestamps=tb - 1, ts_begin=tb,
                                max_initial_index=max_initial)
    want = logits.clone()
    rules.apply_ops(want, FilterContext(hist, lens, ("r",) * R))
    got = logits.clone().to(DEV)
    apply_timestamp_rules(got, hist.to(DEV), lens.to(DEV), tb - 2, tb - 1, tb, max_initial)
    got = got.cpu()
    # the margin the last rule decided on: the text logits as the other rules leave them
    # (timestamps lowered so that the last rule cannot fire) against the timestamps' mass
    low = logits.clone()
    low[:, tb:] -= 1e4
    rules.apply_ops(low, FilterContext(hist, lens, ("r",) * R))
    margin = (torch.logsumexp(want[:, tb:].double(), -1) - low[:, :tb].double().amax(-1)).abs()
    clear = ~(margin < 1e-4)  # NaN (both sides -inf): clear too
    assert clear.sum() >= R - 1
    assert torch.equal(got[clear], want[clear])
    forced = torch.isinf(want[:, :tb]).all(1) & torch.isfinite(low[:, :tb]).any(1)
    assert forced.any() and torch.isfinite(want[:, :tb]).any(1).any()  # fired, and not
    assert forced.sum() > R // 2 if ts_scale > 0 else forced.sum() < R // 2
    assert torch.isinf(got[0, :tb]).all() and torch.isinf(got[0, tb - 1])  # first: timestamps


def test_bad_inputs_raise():
    logits = torch.zeros(2, 50, device=DEV)
    hist = torch.zeros(2, 4, dtype=torch.int64, device=DEV)
    lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="float32"):
        apply_timestamp_rules(logits.half(), hist, lens, 1, 2, 40, None)
    with pytest.raises(ValueError, match="history"):
        apply_timestamp_rules(logits, hist.int(), lens, 1, 2, 40, None)
    with pytest.raises(ValueError, match="history"):
        apply_timestamp_rules(logits, hist[:1], lens, 1, 2, 40, None)
    with pytest.raises(ValueError, match="ts_begin"):
        apply_timestamp_rules(logits, hist, lens, 1, 2, 51, None)
    apply_timestamp_rules(logits[:0], hist[:0], lens[:0], 1, 2, 40, None)  # no rows: nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the filter takes the kernel on CUDA")
def test_the_filter_takes_the_kernel_on_cuda(monkeypatch):
    """On CUDA ``ApplyTimestampRules.apply`` runs the kernel (the tensor ops not called) and
    gives the tensor ops' result."""
    gen = torch.Generator().manual_seed(3)
    hist, lens = _histories(200, 300, 12, gen)
    logits = torch.randn(hist.shape[0], 300, generator=gen)
    rules = ApplyTimestampRules(eot=198, no_timestamps=199, ts_begin=200, max_initial_index=50)
    want = logits.clone()
    rules.apply_ops(want, FilterContext(hist, lens, ("r",) * len(lens)))
    monkeypatch.setattr(ApplyTimestampRules, "apply_ops", lambda *a: pytest.fail("tensor ops"))
    got = logits.cuda()
    rules.apply(got, FilterContext(hist.cuda(), lens.cuda(), ("r",) * len(lens)))
    assert torch.equal(got.cpu(), want)


_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from edserve.kernels import timestamp_rules as m
sig = {"Logits": "*fp32", "History": "*i64", "Lengths": "*i64", "stride_l": "i32",
       "stride_h": "i32", "n_cols": "i32", "hist_cols": "i32", "eot": "i32", "no_ts": "i32",
       "tb": "i32", "top": "i32", "BLOCK_V": "constexpr", "BLOCK_C": "constexpr"}
src = ASTSource(m._timestamp_rules_kernel, sig,
                constexprs={"BLOCK_V": m.BLOCK_V, "BLOCK_C": 512})
assert compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


def test_kernel_compiles_for_the_h200():
    """The interpreter accepts what the compiler refuses: the kernel compiles to an sm_90
    cubin, no GPU needed (a subprocess: the test session runs the interpreter)."""
    import os
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
