"""Triton grouped cross-attention vs a float64 reference (CPU: the Triton interpreter).

A batch mixes beam-like groups and greedy rows (groups of one). Only the first row of each
group holds its encoder keys; every other row's own region points at NaN slots, so a kernel
that read a member's region instead of the group's one stream would return NaN. The output
buffer is NaN-poisoned so every listed row must be written. Encoder lengths 0, 1, a
page-misaligned one and 1500, at page sizes 1/16/64/128, keys by token (flat) and by page
(aligned).
"""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.grouped_cross_attention import grouped_cross_attention

SCALE = 0.3
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
WIDTH = 16  # MAX_GROUP_ROWS: the engine's padded group width
# (encoder length, batch rows) per group; rows interleaved to show no adjacency is assumed
GROUPS = [(1500, [0, 3, 5, 6, 8]), (0, [1]), (37, [2]), (1, [4, 9]), (200, [7])]
SMALL = [(130, [0, 2, 3]), (0, [1]), (1, [4])]


def make_case(ps: int, hq: int, hkv: int, d: int, dtype=torch.float32, seed: int = 0,
              groups=GROUPS):
    g = torch.Generator().manual_seed(seed)
    B = sum(len(rows) for _, rows in groups)
    pages_per_row = max(-(-n // ps) for n, _ in groups) + 1
    num_pages = 2 + len(groups) * pages_per_row + 1  # page 0: padding, page 1: NaN junk
    k = torch.full((num_pages * ps, hkv, d), float("nan"), dtype=torch.float64)
    v = torch.full_like(k, float("nan"))
    perm = (torch.randperm(num_pages - 2, generator=g) + 2).tolist()
    pool_rows = (torch.randperm(B + 2, generator=g)[:B] + 1).tolist()  # pool row 0: padding
    table = torch.ones(B + 3, pages_per_row, dtype=torch.int64)  # rows point at NaN page 1
    r2t = ps + torch.arange(pages_per_row * ps).repeat(B + 3, 1) % ps  # NaN slots of page 1
    kv_lens = torch.zeros(B, dtype=torch.int32)
    group_rows = torch.full((B, WIDTH), -1, dtype=torch.int64)
    for gi, (n, rows) in enumerate(groups):
        group_rows[gi, :len(rows)] = torch.tensor(rows)
        kv_lens[rows] = n
        lead = rows[0]
        pages = torch.tensor([perm.pop() for _ in range(pages_per_row)])
        table[lead] = pages
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        r2t[pool_rows[lead]] = slots
        k[slots[:n]] = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
        v[slots[:n]] = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(B, hq, d, generator=g, dtype=torch.float64)
    return dict(groups=groups, q=q, k=k, v=v, group_rows=group_rows, kv_lens=kv_lens,
                table=table[:B], r2t=r2t.to(torch.int32), pool_rows=torch.tensor(pool_rows),
                ps=ps, dtype=dtype)


def reference(c) -> torch.Tensor:
    """float64: every row of a group attends over its lead's keys (zeros when it has none)."""
    q, k, v = c["q"], c["k"], c["v"]
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    for _, rows in c["groups"]:
        lead = rows[0]
        n = int(c["kv_lens"][lead])
        if n == 0:
            continue
        slots = c["r2t"][c["pool_rows"][lead], :n].long()
        keys = k[slots].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        vals = v[slots].repeat_interleave(hq // hkv, dim=1)
        for i in rows:
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * SCALE, dim=-1)
            out[i] = torch.einsum("hn,nhd->hd", w, vals)
    return out


def run(c, by_page: bool, num_splits=None, heads_first=True) -> torch.Tensor:
    dt = c["dtype"]
    q, k, v = (c[x].to(dt).to(DEV) for x in ("q", "k", "v"))
    out = torch.full_like(q, float("nan"))
    addr = dict(page_table=c["table"].to(DEV), page_size=c["ps"]) if by_page else \
        dict(req_to_token=c["r2t"].to(DEV), req_pool_indices=c["pool_rows"].to(DEV))
    grouped_cross_attention(q, k, v, c["group_rows"].to(DEV), c["kv_lens"].to(DEV), SCALE,
                            out=out, num_splits=num_splits, heads_first=heads_first, **addr)
    return out.cpu()


@pytest.mark.parametrize("ps", [1, 16, 64, 128])
@pytest.mark.parametrize("by_page", [False, True], ids=["flat", "aligned"])
def test_matches_float64_reference(ps, by_page):
    c = make_case(ps, hq=2, hkv=2, d=16, seed=ps)
    torch.testing.assert_close(run(c, by_page).double(), reference(c), atol=2e-5, rtol=2e-5)


def test_page_size_not_a_power_of_two():
    c = make_case(24, hq=2, hkv=2, d=16, seed=2, groups=SMALL)
    torch.testing.assert_close(run(c, True).double(), reference(c), atol=2e-5, rtol=2e-5)


def test_gqa_heads_and_split_kv():
    c = make_case(16, hq=4, hkv=2, d=32, seed=5, groups=SMALL)
    ref = reference(c)
    for splits in (1, 3):
        torch.testing.assert_close(run(c, True, splits).double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("by_page", [False, True], ids=["flat", "aligned"])
def test_grid_order_changes_nothing(by_page):
    """Heads-first and groups-first grids run the same programs: the same bits."""
    c = make_case(16, hq=4, hkv=4, d=16, seed=7, groups=SMALL)
    a, b = run(c, by_page, 2, heads_first=True), run(c, by_page, 2, heads_first=False)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), reference(c), atol=2e-5, rtol=2e-5)


def test_bfloat16():
    c = make_case(64, hq=2, hkv=1, d=16, dtype=torch.bfloat16, seed=9, groups=SMALL)
    torch.testing.assert_close(run(c, False).double(), reference(c), atol=2e-2, rtol=2e-2)


def test_bad_arguments_raise():
    c = make_case(16, hq=2, hkv=2, d=16, groups=SMALL)
    c = {key: val.to(DEV) if torch.is_tensor(val) else val for key, val in c.items()}
    q, k, v = (c[x].float() for x in ("q", "k", "v"))
    with pytest.raises(ValueError, match="either req_to_token"):
        grouped_cross_attention(q, k, v, c["group_rows"], c["kv_lens"], SCALE)
    with pytest.raises(ValueError, match="either req_to_token"):
        grouped_cross_attention(q, k, v, c["group_rows"], c["kv_lens"], SCALE,
                                page_table=c["table"], page_size=0)
    with pytest.raises(ValueError, match="group_rows"):
        grouped_cross_attention(q, k, v, c["group_rows"].float(), c["kv_lens"], SCALE,
                                page_table=c["table"], page_size=16)
    with pytest.raises(ValueError, match="kv_lens"):
        grouped_cross_attention(q, k, v, c["group_rows"], c["kv_lens"][:3], SCALE,
                                page_table=c["table"], page_size=16)
