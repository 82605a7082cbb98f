"""Triton write_cache_indices (CPU interpreter without CUDA) == the torch fallback."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.write_req_to_token import write_req_to_token_triton  # noqa: E402
from edserve.mem_cache import write_cache_indices  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors


@pytest.fixture(autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_batch(rng: random.Random, num_rows: int, cols: int):
    bs = rng.randint(1, num_rows - 1)
    rows = rng.sample(range(1, num_rows), bs)
    prefix_lens, seq_lens, prefixes = [], [], []
    for _ in range(bs):
        seq = rng.choice([0, 1, cols, rng.randint(0, cols)])
        prefix = rng.choice([0, seq, rng.randint(0, seq)])
        prefix_lens.append(prefix)
        seq_lens.append(seq)
        dtype = rng.choice([torch.int64, torch.int32])
        prefixes.append(torch.randint(1, 10_000, (prefix,), dtype=dtype, device=DEVICE))
    num_new = sum(seq_lens) - sum(prefix_lens)
    out_cache_loc = torch.randint(1, 10_000, (num_new,), dtype=torch.int64, device=DEVICE)
    return dict(
        req_pool_indices=torch.tensor(rows, device=DEVICE),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        prefix_tensors=prefixes,
        out_cache_loc=out_cache_loc,
    )


def reference_rows(r2t: torch.Tensor, b: dict) -> torch.Tensor:
    """Plain per-request loop: the obvious definition."""
    out = r2t.clone()
    off = 0
    for i, row in enumerate(b["req_pool_indices"].tolist()):
        p, s = int(b["prefix_lens"][i]), int(b["seq_lens"][i])
        out[row, :p] = b["prefix_tensors"][i].to(torch.int32)
        out[row, p:s] = b["out_cache_loc"][off : off + s - p].to(torch.int32)
        off += s - p
    return out


@pytest.mark.parametrize("seed", range(12))
def test_triton_matches_torch_fallback(seed):
    rng = random.Random(seed)
    num_rows, cols = rng.randint(2, 6), rng.choice([1, 7, 33, 64])
    batch = random_batch(rng, num_rows, cols)
    base = torch.randint(-5, 0, (num_rows, cols), dtype=torch.int32, device=DEVICE)
    via_triton, via_torch = base.clone(), base.clone()
    write_cache_indices(via_triton, **batch, use_triton=True)
    write_cache_indices(via_torch, **batch, use_triton=False)
    assert torch.equal(via_triton, via_torch)
    assert torch.equal(via_torch, reference_rows(base, batch))


def test_kernel_loops_over_several_blocks():
    # small BLOCK so each request's prefix and new slots span several loop iterations
    r2t = torch.zeros((3, 40), dtype=torch.int32, device=DEVICE)
    i64 = dict(dtype=torch.int64, device=DEVICE)
    prefix_data = torch.arange(100, 113, **i64)  # req 0: 13 prefix slots, req 1: none
    out_cache_loc = torch.arange(200, 226, **i64)  # req 0: 17 new, req 1: 9 new
    write_req_to_token_triton(
        r2t,
        req_pool_indices=torch.tensor([2, 1], **i64),
        prefix_lens=torch.tensor([13, 0], **i64),
        seq_lens=torch.tensor([30, 9], **i64),
        prefix_starts=torch.tensor([0, 13], **i64),
        prefix_data=prefix_data,
        extend_starts=torch.tensor([0, 17], **i64),
        out_cache_loc=out_cache_loc,
        block=4,
    )
    assert r2t[2, :30].tolist() == list(range(100, 113)) + list(range(200, 217))
    assert r2t[1, :9].tolist() == list(range(217, 226))
    assert r2t[2, 30:].abs().sum() == 0 and r2t[1, 9:].abs().sum() == 0 and r2t[0].abs().sum() == 0


def test_all_empty_batch_writes_nothing():
    r2t = torch.zeros((3, 4), dtype=torch.int32, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    write_cache_indices(
        r2t,
        torch.tensor([1, 2], device=DEVICE),
        torch.zeros(2, dtype=torch.int64, device=DEVICE),
        torch.zeros(2, dtype=torch.int64, device=DEVICE),
        [empty, empty],
        empty,
        use_triton=True,
    )
    assert r2t.abs().sum() == 0
