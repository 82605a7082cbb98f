"""Triton one-pass top-k of selected logits rows vs ``torch.topk`` (CPU: the Triton
interpreter): values equal, token ids equal where values are distinct, distinct ids always."""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.row_topk import row_topk

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def check(logits: torch.Tensor, rows: torch.Tensor, k: int, block=None) -> None:
    vals, idx = row_topk(logits.to(DEV), rows.to(DEV), k, block=block)
    vals, idx = vals.cpu(), idx.cpu()
    ref_v, ref_i = torch.topk(logits[rows], k, dim=-1)
    assert torch.equal(vals, ref_v)  # the same values, largest first
    assert torch.equal(logits[rows].gather(1, idx), vals)  # each id holds its value
    for r in range(rows.shape[0]):
        assert len(set(idx[r].tolist())) == k  # distinct ids, as torch.topk
        finite = torch.isfinite(ref_v[r])
        # where values are distinct, the ids are torch's
        distinct = torch.tensor([(ref_v[r] == v).sum() == 1 for v in ref_v[r]]) & finite
        assert torch.equal(idx[r][distinct], ref_i[r][distinct])


@pytest.mark.parametrize("block", [None, 512], ids=["default", "many-blocks"])
@pytest.mark.parametrize("k", [1, 2, 6, 11])
def test_matches_torch_topk(k, block):
    """``block`` 512: ten blocks a row, most skipped against the running k-th value."""
    g = torch.Generator().manual_seed(k)
    V = 5000  # not a multiple of the block: a partial last block
    logits = torch.randn(7, V, generator=g) * 4
    logits[2, ::3] = float("-inf")  # suppressed tokens
    logits[4, -1] = 50.0  # the maximum in the partial last block
    logits[5, :10] = 30.0  # ties: smaller token ids first
    rows = torch.tensor([6, 0, 2, 4, 5, 2])  # any subset and order, repeats allowed
    check(logits, rows, k, block)
    vals, idx = row_topk(logits.to(DEV), rows.to(DEV), k, block=block)
    if k >= 2:
        assert idx[4, :2].tolist() == [0, 1]  # row 5: the tie at 30.0 by token id


@pytest.mark.parametrize("block", [None, 256], ids=["default", "many-blocks"])
def test_rows_with_few_finite_logits(block):
    """Fewer finite logits than k: the finite ones first, then distinct -inf ids (the
    smallest ids), never an id past the vocabulary."""
    V = 3000
    logits = torch.full((3, V), float("-inf"))
    logits[0, 2500] = 1.0
    logits[0, 7] = 2.0
    logits[2] = torch.linspace(-1, 1, V)
    vals, idx = row_topk(logits.to(DEV), torch.tensor([0, 1, 2]).to(DEV), 5, block=block)
    vals, idx = vals.cpu(), idx.cpu()
    assert idx[0, :2].tolist() == [7, 2500] and vals[0, :2].tolist() == [2.0, 1.0]
    assert torch.isinf(vals[0, 2:]).all() and idx[0, 2:].tolist() == [0, 1, 2]
    assert idx[1].tolist() == [0, 1, 2, 3, 4] and torch.isinf(vals[1]).all()
    assert idx[2].tolist() == [V - 1, V - 2, V - 3, V - 4, V - 5]


def test_bad_arguments_raise():
    x = torch.randn(2, 100).to(DEV)
    rows = torch.tensor([0, 1]).to(DEV)
    with pytest.raises(ValueError, match="k must"):
        row_topk(x, rows, 0)
    with pytest.raises(ValueError, match="k must"):
        row_topk(x, rows, 101)
    with pytest.raises(ValueError, match="float32"):
        row_topk(x.double(), rows, 2)
    with pytest.raises(ValueError, match="rows"):
        row_topk(x, rows.float(), 2)
    vals, idx = row_topk(x, rows[:0], 3)
    assert vals.shape == (0, 3) and idx.shape == (0, 3)

