"""The grouped decode self-attention kernel (CPU interpreter without CUDA) against a float64
reference that reads every row's own keys: beam-like groups whose histories share a prefix
and part at different points, greedy rows (groups of one), a group whose members' prompts
differ (it shares nothing), a full history (shares nothing), a row without keys, unused
group slots, rows of a group far apart in the batch; by token (flat) and by page (aligned)
at page sizes 1 / 16 / 64 / 128."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.grouped_self_attention import grouped_self_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors
H, D = 2, 16
HIST_COLS = 40

# (prompt length, sampled tokens) per batch row, and the groups (batch rows, lead first)
ROWS = [
    (3, [5, 6, 7, 8, 9, 10, 11]),  # 0: lead of a beam group
    (3, [5, 6, 7, 8, 1, 2, 3]),  # 1: parts from 0 at token 4
    (4, [1, 2]),  # 2: a greedy row
    (3, [5, 6, 7, 8, 9, 10, 12]),  # 3: parts from 0 at the last token
    (2, [4, 4, 4]),  # 4: lead of a group whose prompts differ
    (3, [4, 4]),  # 5: the same kv_len, another prompt length
    (5, list(range(1, HIST_COLS + 1))),  # 6: a full history, alone in its group
    (5, list(range(1, HIST_COLS + 1))),  # 7: its sibling
    (0, []),  # 8: no keys at all
    (2, [9, 9, 9, 9]),  # 9: lead of a pair that shares everything
    (2, [9, 9, 9, 9]),  # 10
    (3, [7, 1, 2, 3, 4, 5, 6]),  # 11: parts from 0 at token 0 (shares only the prompt)
]
GROUPS = [[0, 1, 3, 11], [2], [4, 5], [6, 7], [8], [9, 10]]


def _setup(page_size: int, by_page: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B = len(ROWS)
    max_cols = 64 + 64 + HIST_COLS + 8  # encoder columns, then the decoder region
    pages_per_row = -(-max_cols // page_size) + 1
    num_pages = (B + 1) * pages_per_row + 1
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0: padding
    k = torch.randn(num_pages * page_size, H, D, generator=gen, dtype=torch.float64)
    v = torch.randn(num_pages * page_size, H, D, generator=gen, dtype=torch.float64)
    values: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # prefix -> its key's K/V
    pool_rows = torch.randperm(B, generator=gen) + 1  # req_to_token rows (row 0: padding)
    req_to_token = torch.zeros(B + 2, pages_per_row * page_size, dtype=torch.int32)
    page_table = torch.zeros(B, pages_per_row, dtype=torch.int32)
    history = torch.randint(0, 50, (B + 2, HIST_COLS), generator=gen)
    history_lens = torch.zeros(B + 2, dtype=torch.int64)
    kv_lens, starts, ref_slots = [], [], []
    for b, (prompt, toks) in enumerate(ROWS):
        pages = order[b * pages_per_row:(b + 1) * pages_per_row]
        slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)  # by column
        pr = int(pool_rows[b])
        req_to_token[pr] = slots.to(torch.int32)
        page_table[b] = pages.to(torch.int32)
        col0 = (64 // page_size) * page_size if by_page else 37 + b  # the decoder's first column
        group = next(g for g in GROUPS if b in g)
        seq = [("prompt", group[0] if b not in (4, 5) else b)] * prompt + list(toks)
        for j in range(len(seq)):
            key = tuple(seq[:j + 1])
            if key not in values:
                values[key] = (torch.randn(H, D, generator=gen, dtype=torch.float64),
                               torch.randn(H, D, generator=gen, dtype=torch.float64))
            k[slots[col0 + j]], v[slots[col0 + j]] = values[key]
        n = min(len(toks), HIST_COLS)
        history[pr, :n] = torch.tensor(toks[:n], dtype=torch.int64)
        history_lens[pr] = n
        kv_lens.append(len(seq))
        starts.append(col0 // page_size if by_page else col0)
        ref_slots.append(slots[col0:col0 + len(seq)])
    width = 16
    group_rows = torch.full((B, width), -1, dtype=torch.int64)
    for i, g in enumerate(GROUPS):
        group_rows[i + 2, :len(g)] = torch.tensor(g)  # slots 0, 1 and the last ones unused
    q = torch.randn(B, H, D, generator=gen, dtype=torch.float64)
    ref = torch.zeros(B, H, D, dtype=torch.float64)
    for b, sl in enumerate(ref_slots):
        if len(sl):
            kb, vb = k[sl].to(dtype).double(), v[sl].to(dtype).double()  # [n, H, D]
            s = torch.einsum("hd,nhd->hn", q[b].to(dtype).double(), kb) * D ** -0.5
            ref[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
    dev = dict(device=DEVICE)
    args = (q.to(dtype).to(**dev), k.to(dtype).to(**dev), v.to(dtype).to(**dev),
            group_rows.to(**dev), torch.tensor(kv_lens, **dev), torch.tensor(starts, **dev),
            pool_rows.to(**dev), history.to(**dev), history_lens.to(**dev), D ** -0.5)
    keys = {"page_table": page_table.to(**dev), "page_size": page_size} if by_page \
        else {"req_to_token": req_to_token.to(**dev)}
    return args, keys, ref


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("by_page", [False, True], ids=["flat", "aligned"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_equals_per_row_reference(page_size, by_page, dtype, tol):
    args, keys, ref = _setup(page_size, by_page, dtype, seed=page_size + by_page)
    out = grouped_self_attention(*args, **keys)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
    assert torch.count_nonzero(out[8]) == 0  # no keys: zeros


def test_reads_the_shared_prefix_from_the_lead():
    """The prefix the histories say is shared comes from the lead's slots: spoil a member's
    copy of a shared key and its output does not move; spoil one past the shared prefix and
    it does."""
    args, keys, _ = _setup(16, False, torch.float32, seed=3)
    q, k, v, groups, kv_lens, starts, pool_rows, hist, hist_lens, scale = args
    rtt = keys["req_to_token"]
    base = grouped_self_attention(*args, **keys)

    def spoiled(row: int, j: int) -> torch.Tensor:
        k2 = k.clone()
        k2[rtt[pool_rows[row], starts[row] + j].long()] += 5.0
        return grouped_self_attention(q, k2, v, groups, kv_lens, starts, pool_rows, hist,
                                      hist_lens, scale, **keys)

    # rows 0, 1, 3, 11 share their 3 prompt keys (row 11 parts at its first token): row 1's
    # key 2 is read from the lead, its key 3 is its own
    torch.testing.assert_close(spoiled(1, 2)[1], base[1], atol=0, rtol=0)
    assert not torch.allclose(spoiled(1, 3)[1], base[1])
    # rows 9 and 10 share every key: row 10's last key comes from row 9
    torch.testing.assert_close(spoiled(10, 5)[10], base[10], atol=0, rtol=0)
    assert not torch.allclose(spoiled(9, 5)[10], base[10])
    # the pair with different prompts shares nothing: each row reads its own key 0
    assert not torch.allclose(spoiled(5, 0)[5], base[5])


def test_bad_inputs_are_refused():
    args, keys, _ = _setup(16, True, torch.float32, seed=0)
    q = args[0]
    with pytest.raises(ValueError, match="no GQA"):
        grouped_self_attention(q, args[1][:, :1].contiguous(), args[2][:, :1].contiguous(),
                               *args[3:], **keys)
    with pytest.raises(ValueError, match="either req_to_token"):
        grouped_self_attention(*args, page_table=keys["page_table"])
    with pytest.raises(ValueError, match="kv_lens"):
        grouped_self_attention(*args[:4], args[4][:-1], *args[5:], **keys)
    with pytest.raises(ValueError, match="history"):
        grouped_self_attention(*args[:7], args[7], args[8][:-1], args[9], **keys)
