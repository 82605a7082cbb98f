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
    assert torch_ops.one_range(torch.arange(first, first + S)) == (first, S)  # fast path
    fast = torch_ops.flat_attention(*args)
    # the same keys at scattered slots: the gathering path
    perm = torch.randperm(slots)
    kc2, vc2 = torch.empty_like(kc), torch.empty_like(vc)
    kc2[perm], vc2[perm] = kc, vc
    table2 = perm[None].to(torch.int32)  # column j -> where slot j went
    assert torch_ops.one_range(perm[first:first + S]) is None
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


@pytest.mark.parametrize("kind", ["decode", "one_range", "prefill"])
def test_a_batch_memo_is_filled_once_and_gives_the_same_result(kind):
    """Every layer of a step passes its plan's memo: the first call fills it (key indices,
    decode mask, contiguity), the next layer's caches are read through it, same numbers as
    without."""
    torch.manual_seed(1)
    slots, D = 96, 8
    table = torch.arange(4 * 24, dtype=torch.int32).reshape(4, 24)  # request b: row b
    if kind == "one_range":  # one request, all its queries see all keys
        rows, lens, T, max_q, causal = [2], [20], 3, 3, False
    elif kind == "decode":  # one query per request
        rows, lens, T, max_q, causal = [0, 1, 3], [5, 0, 17], 3, 1, True
    else:  # several queries per request, causal: the general path
        rows, lens, T, max_q, causal = [0, 3], [6, 9], 5, 3, True
    B = len(rows)
    cu = torch.tensor([0, 1, 2, 3] if kind == "decode" else
                      ([0, 3] if kind == "one_range" else [0, 3, 5]), dtype=torch.int32)
    memo: dict = {}
    for _layer in range(2):  # another layer: other caches, the same key tables
        kc, vc = torch.randn(slots, 2, D), torch.randn(slots, 2, D)
        q = torch.randn(T, 4, D)
        args = (q, kc, vc, table, torch.tensor(rows), torch.zeros(B, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32), cu, max_q, causal, 0.3)
        with_memo = torch_ops.flat_attention(*args, memo=memo)
        assert "key_index" in memo and (kind != "decode" or "decode" in memo)
        assert kind != "one_range" or memo["one_range"] == (2 * 24, 20)
        torch.testing.assert_close(with_memo, torch_ops.flat_attention(*args), rtol=0, atol=0)


@pytest.mark.parametrize("path", ["one_range", "gather", "decode"])
def test_bf16_caches_are_attended_in_bf16_and_match_float64(path, monkeypatch):
    """bf16 queries over a bf16 cache run SDPA in bf16 (it accumulates in float32 itself; no
    float32 copy of the keys), within bf16's error of the float64 reference, on each path."""
    torch.manual_seed(1)
    Hq, Hkv, D, slots, S = 4, 2, 16, 64, 40
    kc = torch.randn(slots, Hkv, D).bfloat16()
    vc = torch.randn(slots, Hkv, D).bfloat16()
    dtypes = []
    sdpa = torch_ops.F.scaled_dot_product_attention
    monkeypatch.setattr(torch_ops.F, "scaled_dot_product_attention",
                        lambda q, k, *a, **kw: dtypes.append((q.dtype, k.dtype)) or
                        sdpa(q, k, *a, **kw))
    if path == "decode":  # two requests, one query each, scattered slots
        table = torch.randperm(slots).view(2, 32).to(torch.int32)
        lens = [S // 2, 25]
        q = torch.randn(2, Hq, D).bfloat16()
        out = torch_ops.flat_attention(q, kc, vc, table, torch.arange(2, dtype=torch.int32),
                                       torch.zeros(2, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32),
                                       torch.arange(3, dtype=torch.int32), 1, False, 0.25)
        wants = [_reference(q[b:b + 1], kc[table[b, :n].long()], vc[table[b, :n].long()], 0.25)
                 for b, n in enumerate(lens)]
    else:  # one request, three queries over S keys: contiguous slots or scattered
        q = torch.randn(3, Hq, D).bfloat16()
        table = (torch.arange(slots) if path == "one_range" else torch.randperm(slots))
        table = table[None].to(torch.int32)
        out = torch_ops.flat_attention(q, kc, vc, table, torch.zeros(1, dtype=torch.int32),
                                       torch.zeros(1, dtype=torch.int32),
                                       torch.tensor([S], dtype=torch.int32),
                                       torch.tensor([0, 3], dtype=torch.int32), 3, False, 0.25)
        cols = table[0, :S].long()
        wants = [_reference(q, kc[cols], vc[cols], 0.25)]
    assert dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in dtypes)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), torch.cat(wants), rtol=2e-2, atol=2e-2)
