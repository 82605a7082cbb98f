"""The sampler's one-read logits kernel vs torch (CPU: the Triton interpreter): argmax equal
(first index on ties), logsumexp close to a float64 reference, top-k log-probabilities equal in
values to ``torch.topk`` minus the float64 logsumexp, ids equal where values are distinct."""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.logit_stats import logit_stats

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _slots(B: int, rows: list[int]) -> torch.Tensor:
    slot = torch.full((B,), -1, dtype=torch.int32)
    slot[rows] = torch.arange(len(rows), dtype=torch.int32)
    return slot


def check(logits: torch.Tensor, rows: list[int], k: int, shape=None) -> None:
    B = logits.shape[0]
    arg, lse, vals, idx = (t.cpu() for t in logit_stats(
        logits.to(DEV), _slots(B, rows).to(DEV), len(rows), k, shape=shape))
    assert torch.equal(arg, torch.argmax(logits, dim=-1))
    ref_lse = torch.logsumexp(logits.double(), dim=-1)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-5)
    if not k:
        return
    sel = logits[rows]
    ref_v, ref_i = torch.topk(sel, k, dim=-1)
    torch.testing.assert_close(vals.double(), ref_v.double() - ref_lse[rows][:, None],
                               rtol=1e-6, atol=1e-5)
    for r in range(len(rows)):
        assert len(set(idx[r].tolist())) == k  # distinct ids, as torch.topk
        assert torch.equal(sel[r].gather(0, idx[r]), ref_v[r])  # each id holds its value
        distinct = torch.tensor([(ref_v[r] == v).sum() == 1 for v in ref_v[r]]) \
            & torch.isfinite(ref_v[r])
        assert torch.equal(idx[r][distinct], ref_i[r][distinct])


@pytest.mark.parametrize("shape", [None, (3, 256, 4), (1, 512, 4), (7, 128, 2)],
                         ids=["default", "3-chunks", "1-chunk", "7-chunks"])
@pytest.mark.parametrize("k", [0, 1, 6])
def test_matches_torch(k, shape):
    g = torch.Generator().manual_seed(k)
    V = 1900  # not a multiple of a block or chunk: a partial last chunk
    logits = torch.randn(6, V, generator=g) * 4
    logits[2, ::3] = float("-inf")  # suppressed tokens
    logits[4, -1] = 50.0  # the maximum in the last chunk
    logits[5, :10] = 30.0  # ties: the first index (argmax) and smaller ids (top-k)
    logits[3, 700] = logits[3, 1500] = 40.0  # a tie across chunks
    check(logits, [5, 0, 2, 4] if k else [], k, shape)
    if k >= 2:
        _, _, _, idx = logit_stats(logits.to(DEV), _slots(6, [5, 3]).to(DEV), 2, k,
                                   shape=shape)
        assert idx[0, :2].tolist() == [0, 1] and idx[1, :2].tolist() == [700, 1500]


@pytest.mark.parametrize("shape", [None, (4, 256, 4)], ids=["default", "4-chunks"])
def test_rows_with_few_finite_logits(shape):
    """All -inf: argmax 0, lse -inf; fewer finite logits than k: the finite ones first, then
    distinct -inf ids (the smallest), never an id past the vocabulary."""
    V = 1100
    logits = torch.full((3, V), float("-inf"))
    logits[0, 1000] = 1.0
    logits[0, 7] = 2.0
    logits[2] = torch.linspace(-1, 1, V)
    arg, lse, vals, idx = (t.cpu() for t in logit_stats(
        logits.to(DEV), _slots(3, [0, 1, 2]).to(DEV), 3, 5, shape=shape))
    assert arg.tolist() == [7, 0, V - 1] and lse[1].item() == float("-inf")
    assert idx[0, :2].tolist() == [7, 1000] and torch.isinf(vals[0, 2:]).all()
    assert idx[0, 2:].tolist() == [0, 1, 2]
    # -inf minus lse -inf: NaN, as the torch sampler's ``topk - logsumexp`` (no filter
    # leaves a row all -inf)
    assert idx[1].tolist() == [0, 1, 2, 3, 4] and torch.isnan(vals[1]).all()
    assert idx[2].tolist() == [V - 1, V - 2, V - 3, V - 4, V - 5]


def test_bad_arguments_raise():
    x = torch.randn(2, 100).to(DEV)
    slot = torch.tensor([0, 1]).to(DEV)
    with pytest.raises(ValueError, match="k must"):
        logit_stats(x, slot, 2, 101)
    with pytest.raises(ValueError, match="float32"):
        logit_stats(x.double(), slot, 2, 2)
    with pytest.raises(ValueError, match="slot"):
        logit_stats(x, slot[:1], 2, 2)
    with pytest.raises(ValueError, match="slot"):
        logit_stats(x, None, 2, 2)
    arg, lse, vals, idx = logit_stats(x[:0])
    assert arg.shape == (0,) and vals.shape == (0, 0)


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from edserve.kernels import logit_stats as m
k = int(sys.argv[1])
ptr = {"Slot": "*i32", "PM": "*fp32", "PS": "*fp32", "PA": "*i32", "PV": "*fp32", "PI": "*i32"}
c = "constexpr"
chunk = ASTSource(m._chunk_kernel, {"Logits": "*fp32", **ptr, "stride_l": "i32",
                  "n_cols": "i32", "chunk": "i32", "SPLIT": c, "K": c, "KP": c, "BLOCK": c},
                  constexprs={"SPLIT": 4, "K": k, "KP": 8, "BLOCK": 2048})
merge = ASTSource(m._merge_kernel, {**ptr, "Argmax": "*i64", "Lse": "*fp32", "Vals": "*fp32",
                  "Idx": "*i64", "SPLIT": c, "SP": c, "K": c, "KP": c},
                  constexprs={"SPLIT": 4, "SP": 4, "K": k, "KP": 8})
for src in (chunk, merge):
    assert compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


@pytest.mark.parametrize("k", [0, 6])
def test_kernels_compile_for_the_h200(k):
    """The interpreter accepts what the compiler refuses (a non-constexpr global, say): both
    launches compile to an sm_90 cubin, no GPU needed (a subprocess: the test session runs
    the interpreter)."""
    import os
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(k)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
