"""The torch attention ops' CPU fast path: one request whose keys are one contiguous slot range
is attended over a view of the caches (no gather); the result equals the gathering path and a
float64 softmax reference."""

from __future__ import annotations

import pytest
import torch

from edserve.layers.attention import torch_ops


def _reference(q, k, v, scale):  # q [T, Hq, D]; k, v [S, Hkv, D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    w = torch.einsum("thd,shd->hts", q.double(), k) * scale
    return torch.einsum("hts,shd->thd", w.softmax(-1), v)


@pytest.mark.parametrize(("T", "Hq", "Hkv"), [(1, 4, 4), (5, 4, 4), (3, 4, 2)])
def test_contiguous_range_equals_gather_and_float64(T, Hq, Hkv):
    torch.manual_seed(0)
    slots, S, D = 64, 23, 16
    kc, vc = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    q = torch.randn(T, Hq, D)
    first = 9
    table = torch.arange(slots, dtype=torch.int32)[None]  # one request, row = slot ids
    cu_q = torch.tensor([0, T], dtype=torch.int32)
    args = (q, kc, vc, table, torch.zeros(1, dtype=torch.int32), torch.tensor([first]),
            torch.tensor([S], dtype=torch.int32), cu_q, T, False, 0.25)
    assert torch_ops._attend_one_range(q, kc, vc, torch.arange(first, first + S), 0.25) \
        is not None  # the fast path is taken
    fast = torch_ops.flat_attention(*args)
    # the same keys at scattered slots: the gathering path
    perm = torch.randperm(slots)
    kc2, vc2 = torch.empty_like(kc), torch.empty_like(vc)
    kc2[perm], vc2[perm] = kc, vc
    table2 = perm[None].to(torch.int32)  # column j -> where slot j went
    assert torch_ops._attend_one_range(q, kc2, vc2, perm[first:first + S], 0.25) is None
    slow = torch_ops.flat_attention(q, kc2, vc2, table2, *args[4:])
    want = _reference(q, kc[first:first + S], vc[first:first + S], 0.25)
    torch.testing.assert_close(fast.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_no_keys_gives_zeros_and_causal_prefill_keeps_the_mask():
    torch.manual_seed(0)
    kc, vc = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    q = torch.randn(3, 2, 8)
    table = torch.arange(16, dtype=torch.int32)[None]
    zero = torch.zeros(1, dtype=torch.int32)
    out = torch_ops.flat_attention(q, kc, vc, table, zero, zero, zero,
                                   torch.tensor([0, 3], dtype=torch.int32), 3, False, 1.0)
    assert torch.equal(out, torch.zeros_like(q))
    # causal, 3 queries over 5 keys: query i sees keys j <= 2 + i (not the fast path's "all")
    out = torch_ops.flat_attention(q, kc, vc, table, zero, zero,
                                   torch.tensor([5], dtype=torch.int32),
                                   torch.tensor([0, 3], dtype=torch.int32), 3, True, 1.0)
    for i in range(3):
        want = _reference(q[i:i + 1], kc[:3 + i], vc[:3 + i], 1.0)
        torch.testing.assert_close(out[i:i + 1].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_decode_one_query_per_request_matches_float64(causal):
    """The decode path (one query per request, all of its keys visible): scattered slots,
    a request without keys (zero output), grouped-query heads."""
    torch.manual_seed(0)
    Hq, Hkv, D, slots = 4, 2, 8, 40
    kc, vc = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    lens = [3, 0, 7, 1]
    table = torch.randperm(4 * 10).view(4, 10).to(torch.int32)  # request b's keys: row b
    q = torch.randn(len(lens), Hq, D)
    zero = torch.zeros(4, dtype=torch.int32)
    out = torch_ops.flat_attention(q, kc, vc, table, torch.arange(4, dtype=torch.int32), zero,
                                   torch.tensor(lens, dtype=torch.int32),
                                   torch.arange(5, dtype=torch.int32), 1, causal, 0.5)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        slots_b = table[b, :n].long()
        want = _reference(q[b:b + 1], kc[slots_b], vc[slots_b], 0.5)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=1e-5, atol=1e-5)
