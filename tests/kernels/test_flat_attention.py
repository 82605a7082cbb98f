"""Triton flat (token-indexed) attention vs the float64 torch reference (CPU: interpreter).

The pool is laid out page by page (any page size, pages in random order) and each request's
keys start mid-row at ``kv_start`` (like the decoder region after a 1500-token encoder). Slots
that are not a valid key are NaN (except slot 0, which the reference reads for masked
positions); the output buffer is NaN-poisoned so every element must be written.
"""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.flat_attention import flat_attention
from edserve.layers.attention import torch_ops

SCALE = 0.125
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _dev(x):
    return x.to(DEV) if torch.is_tensor(x) else x


def make_flat(kv_lens, q_lens, ps, hq, hkv, d, dtype=torch.float32, seed=0):
    """Random pool of ``ps``-slot pages; request b's row holds its slots page by page."""
    g = torch.Generator().manual_seed(seed)
    B = len(kv_lens)
    start = [int(torch.randint(0, 2 * ps + 4, (1,), generator=g)) for _ in range(B)]
    used = [-(-(s + n) // ps) for s, n in zip(start, kv_lens, strict=True)]
    num_pages = sum(used) + 3  # page 0 = padding
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    rows, cols = B + 3, max([s + n for s, n in zip(start, kv_lens, strict=True)], default=0) + 5
    r2t = torch.randint(ps, num_pages * ps, (rows, cols), generator=g)  # junk: NaN slots
    pool_rows = (torch.randperm(rows - 1, generator=g)[:B] + 1).tolist()  # row 0 = padding
    k = torch.full((num_pages * ps, hkv, d), float("nan"), dtype=torch.float64)
    v = torch.full_like(k, float("nan"))
    k[0] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
    v[0] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
    for b in range(B):
        pages = torch.tensor([perm.pop() for _ in range(used[b])], dtype=torch.long)
        pos = torch.arange(start[b] + kv_lens[b])
        slots = pages[pos // ps] * ps + pos % ps
        r2t[pool_rows[b], : len(pos)] = slots
        keys = slots[start[b] :]  # only this request's keys get finite values
        k[keys] = torch.randn(len(keys), hkv, d, generator=g, dtype=torch.float64)
        v[keys] = torch.randn(len(keys), hkv, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g, dtype=torch.float64)
    i32 = dict(dtype=torch.int32)
    pool_rows = torch.tensor(pool_rows, dtype=torch.long)
    return dict(
        q=q.to(dtype),
        k_cache=k.to(dtype),
        v_cache=v.to(dtype),
        req_to_token=r2t.to(torch.int32),
        req_pool_indices=pool_rows,
        kv_start=torch.tensor(start, **i32),
        kv_lens=torch.tensor(kv_lens, **i32),
        cu_q=cu,
        max_q=max(q_lens, default=0),
    )


def reference(a, causal, kv_ranges=None):
    return torch_ops.flat_attention(
        a["q"].double(),
        a["k_cache"].double(),
        a["v_cache"].double(),
        a["req_to_token"],
        a["req_pool_indices"],
        a["kv_start"],
        a["kv_lens"],
        a["cu_q"],
        a["max_q"],
        causal,
        SCALE,
        kv_ranges,
    )


def run(a, causal, num_splits=None, out=None, kv_ranges=None):
    a = {k: _dev(v) for k, v in a.items()}  # the kernel runs where the GPU is, if any
    out = torch.full_like(a["q"], float("nan")) if out is None else _dev(out)  # poison
    kv_ranges = _dev(kv_ranges)
    return flat_attention(
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["req_to_token"],
        a["req_pool_indices"],
        a["kv_start"],
        a["kv_lens"],
        a["cu_q"],
        a["max_q"],
        causal,
        SCALE,
        kv_ranges,
        out=out,
        num_splits=num_splits,
    ).cpu()


def check(out, ref, tol=1e-5):
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.3g}"
    zero_rows = ref.abs().amax(dim=(1, 2)) == 0  # empty key set or causal row before key 0
    assert (out[zero_rows] == 0).all()


@pytest.mark.parametrize("ps", [1, 4, 16, 64, 128])
@pytest.mark.parametrize("mode", ["decode", "causal", "full"])
@pytest.mark.parametrize("group", [1, 2])
def test_matches_reference(ps, mode, group):
    kv_lens = [0, 1, 37, 150]  # empty, one key, partial key block, several blocks
    q_lens = [1, 1, 1, 1] if mode == "decode" else [2, 3, 5, 4]  # request 1: rows before key 0
    a = make_flat(kv_lens, q_lens, ps, hq=2 * group, hkv=2, d=32, seed=ps + group)
    causal = mode != "full"
    ref = reference(a, causal)
    check(run(a, causal, num_splits=1 + 2 * (group - 1)), ref)  # group 2: split-KV path


@pytest.mark.parametrize("ps", [1, 128])
def test_encoder_like_decode(ps):
    """Whisper cross-attention at decode: 1500 keys, a text-only request in the batch."""
    a = make_flat([1500, 0, 1500], [1, 1, 1], ps, hq=2, hkv=1, d=64, seed=7)
    check(run(a, False, num_splits=4), reference(a, False))


@pytest.mark.parametrize("d", [16, 80, 128])
def test_head_dims(d):
    a = make_flat([0, 19, 70], [3, 2, 4], 16, hq=6, hkv=2, d=d, seed=d)
    check(run(a, True), reference(a, True))


def test_group_not_power_of_two_and_all_empty():
    a = make_flat([33, 5], [4, 1], 8, hq=10, hkv=2, d=32, seed=3)
    check(run(a, True, num_splits=2), reference(a, True))
    e = make_flat([0, 0], [1, 1], 1, hq=2, hkv=1, d=32, seed=4)
    assert (run(e, False, num_splits=2) == 0).all()


def test_kv_ranges():
    """Per-token key windows (Mllama cross-attention masks), including empty windows."""
    a = make_flat([130, 0, 40], [3, 1, 2], 4, hq=4, hkv=2, d=32, seed=9)
    rng = torch.tensor(
        [[0, 130], [70, 129], [65, 200], [0, 0], [5, 6], [30, 10]], dtype=torch.int64
    )
    ref = reference(a, False, rng)
    for splits in (1, 2):
        check(run(a, False, num_splits=splits, kv_ranges=rng), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    a = make_flat([0, 50, 130], [2, 3, 1], 16, hq=4, hkv=2, d=64, dtype=dtype, seed=11)
    out = run(a, True)
    assert out.dtype == dtype
    check(out, reference(a, True), tol=2e-2)


def test_strided_q_and_out():
    a = make_flat([10, 70], [3, 2], 4, hq=4, hkv=2, d=32, seed=5)
    qkv = torch.randn(a["q"].shape[0], 8, 32)
    qkv[:, :4] = a["q"]
    a["q"] = qkv[:, :4]  # non-contiguous view, like a fused qkv projection
    big = torch.full((a["q"].shape[0], 6, 32), float("nan"))
    out = run(a, True, out=big[:, 1:5])
    check(out, reference(a, True))
    assert big[:, 0].isnan().all() and big[:, 5].isnan().all()


def test_empty_batch():
    a = make_flat([], [], 1, hq=2, hkv=2, d=32)
    assert run(a, False).shape == (0, 2, 32)


def test_input_validation():
    a = make_flat([5, 9], [1, 2], 1, hq=4, hkv=2, d=32)

    def bad(match, **kw):
        b = {**a, **kw}
        with pytest.raises(ValueError, match=match):
            run(b, False, kv_ranges=b.get("kv_ranges"))

    bad("multiple of kv heads", q=torch.randn(3, 3, 32))
    bad("head_dim mismatch", q=torch.randn(3, 4, 16))
    bad("dtype mismatch", v_cache=a["v_cache"].half())
    bad("req_pool_indices", req_pool_indices=a["req_pool_indices"][:1])
    bad("int32 or int64", req_to_token=a["req_to_token"].float())
    bad("kv_lens", kv_lens=a["kv_lens"][:1])
    bad("max_q", max_q=1.5)
    bad("kv_ranges", kv_ranges=torch.zeros(2, 2, dtype=torch.int32))


def test_strided_index_tensor_is_refused():
    a = make_flat([5, 9], [1, 1], 1, hq=2, hkv=2, d=32)
    a = {k: _dev(v) for k, v in a.items()}
    a["kv_lens"] = torch.tensor([[5, 0], [9, 0]], dtype=torch.int32, device=DEV)[:, 0]  # stride 2
    with pytest.raises(ValueError, match="kv_lens must be contiguous"):
        run(a, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_is_read_in_q_dtype(dtype):
    """An fp8 (e4m3, scale 1) KV cache (``--kv-cache-dtype fp8``): keys and values are cast to
    q's dtype as they are read; the reference reads the same e4m3 values in float64."""
    a = make_flat([0, 37, 150], [1, 3, 2], 16, hq=4, hkv=2, d=32, seed=11)
    a["q"] = a["q"].to(dtype)
    a["k_cache"] = a["k_cache"].to(torch.float8_e4m3fn)
    a["v_cache"] = a["v_cache"].to(torch.float8_e4m3fn)
    check(run(a, True), reference(a, True), tol=1e-5 if dtype == torch.float32 else 2e-2)
