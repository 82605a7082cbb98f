"""The three encoder-KV strategies against a float64 dense oracle.

Rows are laid out by hand (random pages, tokens contiguous within a page) exactly as the
allocators do, so these tests isolate the backends' index construction and the empty guard.
"""

from __future__ import annotations

import math

import pytest
import torch

from edserve.layers.attention import Attention, create_backend
from edserve.layers.forward_batch import ForwardBatch, ForwardMode
from edserve.mem_cache import KVPool

H, HKV, D = 4, 2, 16


def _layout(enc_lens, dec_lens, q_lens, strategy, page_size, gen, ops="torch",
            dtype=torch.float64, groups=False):
    """Random paged layout; returns (backend, batch, pool, per-request slot lists).
    ``groups``: a decode batch whose rows are groups of one (the grouped cross read)."""
    backend = create_backend(strategy, page_size, ops)
    regions = [backend.encoder_region(e) for e in enc_lens]
    row_lens = [r + d for r, d in zip(regions, dec_lens, strict=True)]
    pages_per = [math.ceil(n / page_size) for n in row_lens]
    num_pages = sum(pages_per) + 3
    perm = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # page 0 stays padding
    cols = max(row_lens) + page_size
    req_to_token = torch.zeros(len(enc_lens) + 1, cols, dtype=torch.int32)
    slots = []
    for i, n in enumerate(row_lens):
        mine = [perm.pop() for _ in range(pages_per[i])]
        row = [mine[j // page_size] * page_size + j % page_size for j in range(n)]
        req_to_token[i + 1, :n] = torch.tensor(row, dtype=torch.int32)
        slots.append(row)
    pool = KVPool((num_pages + 1) * page_size, page_size, 1, HKV, D, dtype)
    k, v = pool.get_kv(0)
    k.copy_(torch.randn(k.shape, generator=gen, dtype=torch.float64))
    v.copy_(torch.randn(v.shape, generator=gen, dtype=torch.float64))
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    T = cu[-1]
    positions = torch.cat([torch.arange(d - q, d) for d, q in zip(dec_lens, q_lens, strict=True)])
    out_loc = torch.cat([torch.tensor(s[r + d - q:r + d]) for s, r, d, q in
                         zip(slots, regions, dec_lens, q_lens, strict=True)])
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if max(q_lens) == 1 else ForwardMode.EXTEND,
        req_pool_indices=torch.arange(1, len(enc_lens) + 1),
        seq_lens=torch.tensor(dec_lens, dtype=torch.int32),
        prefix_lens=torch.tensor([d - q for d, q in zip(dec_lens, q_lens, strict=True)],
                                 dtype=torch.int32),
        cu_q=torch.tensor(cu, dtype=torch.int32), max_q=max(q_lens), positions=positions,
        out_cache_loc=out_loc.long(), encoder_lens=torch.tensor(enc_lens, dtype=torch.int32),
        encoder_offsets=torch.tensor(regions, dtype=torch.int32), req_to_token=req_to_token,
        kv_pool=pool, attn_backend=backend, page_size=page_size,
        seq_lens_cpu=list(dec_lens), encoder_lens_cpu=list(enc_lens))
    if groups:
        batch.cross_groups = torch.arange(len(enc_lens), dtype=torch.int32)[:, None]
    backend.init_forward_metadata(batch)
    assert T == batch.num_tokens
    return backend, batch, pool, slots, regions


def _dense(q, k, v, causal, scale):
    # q [L, H, D], k/v [S, HKV, D] float64 -> [L, H, D]
    L, S = q.shape[0], k.shape[0]
    if S == 0:
        return torch.zeros_like(q)
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    s = torch.einsum("lhd,shd->hls", q, k) * scale
    if causal:
        mask = torch.arange(S)[None, :] <= (S - L + torch.arange(L))[:, None]
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(s, -1), v)


CASES = {
    "empty": [0, 0],
    "one": [1, 1],
    "whisper": [1500],
    "mixed": [1500, 0, 37, 0],
}


@pytest.mark.parametrize("strategy", ["aligned", "ragged", "flat"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("decode", [True, False])
def test_strategy_matches_dense_oracle(strategy, page_size, case, decode):
    gen = torch.Generator().manual_seed(hash((strategy, page_size, case, decode)) % 2**31)
    enc = CASES[case]
    dec = [int(x) for x in torch.randint(3, 40, (len(enc),), generator=gen)]
    q_lens = [1] * len(enc) if decode else [min(d, 5) for d in dec]
    backend, batch, pool, slots, regions = _layout(enc, dec, q_lens, strategy, page_size, gen)
    scale = D**-0.5
    q = torch.randn(batch.num_tokens, H, D, generator=gen, dtype=torch.float64)
    cross = Attention(0, H, HKV, D, scale, is_cross=True)
    self_ = Attention(0, H, HKV, D, scale, is_cross=False)
    k_new = torch.randn(batch.num_tokens, HKV, D, generator=gen, dtype=torch.float64)
    v_new = torch.randn(batch.num_tokens, HKV, D, generator=gen, dtype=torch.float64)
    out_cross = cross(q, None, None, batch)
    out_self = self_(q, k_new, v_new, batch)
    kc, vc = pool.get_kv(0)
    start = 0
    for i, (e, r, d, ql) in enumerate(zip(enc, regions, dec, q_lens, strict=True)):
        qi = q[start:start + ql]
        enc_slots = torch.tensor(slots[i][:e], dtype=torch.long)
        dec_slots = torch.tensor(slots[i][r:r + d], dtype=torch.long)
        ref_c = _dense(qi, kc[enc_slots], vc[enc_slots], False, scale)
        ref_s = _dense(qi, kc[dec_slots], vc[dec_slots], True, scale)
        torch.testing.assert_close(out_cross[start:start + ql], ref_c, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out_self[start:start + ql], ref_s, rtol=1e-9, atol=1e-9)
        if e == 0:
            assert torch.count_nonzero(out_cross[start:start + ql]) == 0
        start += ql
    # The new tokens' K/V were written at out_cache_loc.
    torch.testing.assert_close(kc[batch.out_cache_loc], k_new)


def test_aligned_pads_encoder_to_pages():
    backend = create_backend("aligned", 128, "torch")
    assert backend.encoder_region(1500) == 1536
    assert backend.encoder_region(0) == 0
    assert create_backend("flat", 128).encoder_region(1500) == 1500
    assert create_backend("ragged", 128).encoder_region(1500) == 1500


def test_all_empty_cross_launches_no_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    backend, batch, *_ = _layout([0, 0], [5, 7], [1, 1], "flat", 16, gen)

    def boom(*a, **k):
        raise AssertionError("kernel launched on an empty key set")

    monkeypatch.setattr(backend, "attend", boom)
    q = torch.randn(2, H, D, dtype=torch.float64)
    out = Attention(0, H, HKV, D, 0.25, is_cross=True)(q, None, None, batch)
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize("strategy", ["aligned", "flat"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_grouped_cross_read_gives_zeros_for_requests_without_encoder(strategy, page_size):
    """The grouped kernel (Triton; the interpreter on CPU) writes zeros for rows whose request
    has no encoder keys itself, so the backend adds no guard pass after it: a decode batch
    mixing a Whisper clip, text-only requests and a short encoder matches the dense oracle."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(page_size)
    enc = CASES["mixed"]
    dec = [int(x) for x in torch.randint(3, 40, (len(enc),), generator=gen)]
    backend, batch, pool, slots, _ = _layout(enc, dec, [1] * len(enc), strategy, page_size,
                                             gen, ops="triton", dtype=torch.float32,
                                             groups=True)
    assert batch.attn_metadata.grouped is not None and batch.attn_metadata.guard.any_empty
    scale = D**-0.5
    q = torch.randn(batch.num_tokens, H, D, generator=gen)
    out = Attention(0, H, HKV, D, scale, is_cross=True)(q, None, None, batch)
    kc, vc = pool.get_kv(0)
    for i, e in enumerate(enc):
        s = torch.tensor(slots[i][:e], dtype=torch.long)
        ref = _dense(q[i:i + 1].double(), kc[s].double(), vc[s].double(), False, scale)
        if e == 0:
            assert torch.count_nonzero(out[i]) == 0
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-5, atol=1e-5)
