"""Triton paged attention vs the float64 torch reference (CPU: Triton interpreter).

K/V slots that are not a valid key of some request are NaN (except padding page 0, which the
reference reads for masked positions), so any unmasked read outside a request's keys shows up
as NaN; the output buffer is NaN-poisoned so every element must be written.
"""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.paged_attention import (
    SUPPORTED_PAGE_SIZES,
    check_page_size,
    paged_attention,
    supported_page_sizes,
)
from edserve.layers.attention import torch_ops

SCALE = 0.125
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _dev(x):
    return x.to(DEV) if torch.is_tensor(x) else x


def make_paged(kv_lens, q_lens, ps, hq, hkv, d, dtype=torch.float32, seed=0):
    """Random pool + page table: request b's pages are random, after a random start offset."""
    g = torch.Generator().manual_seed(seed)
    B = len(kv_lens)
    start = [int(torch.randint(0, 3, (1,), generator=g)) for _ in range(B)]
    used = [s + -(-n // ps) for s, n in zip(start, kv_lens, strict=True)]
    max_pages = max(used, default=0) + 2
    num_pages = sum(used) + 4  # page 0 = padding
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.randint(1, num_pages, (B, max_pages), generator=g)  # junk past the used pages
    k = torch.full((num_pages * ps, hkv, d), float("nan"), dtype=torch.float64)
    v = torch.full_like(k, float("nan"))
    k[:ps] = torch.randn(ps, hkv, d, generator=g, dtype=torch.float64)
    v[:ps] = torch.randn(ps, hkv, d, generator=g, dtype=torch.float64)
    for b in range(B):
        pages = torch.tensor([perm.pop() for _ in range(used[b])], dtype=torch.long)
        table[b, : used[b]] = pages
        pos = torch.arange(kv_lens[b])
        keys = pages[start[b] + pos // ps] * ps + pos % ps  # only real keys get finite values
        k[keys] = torch.randn(len(keys), hkv, d, generator=g, dtype=torch.float64)
        v[keys] = torch.randn(len(keys), hkv, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g, dtype=torch.float64)
    i32 = dict(dtype=torch.int32)
    return dict(
        q=q.to(dtype),
        k_cache=k.to(dtype),
        v_cache=v.to(dtype),
        page_table=table.to(torch.int32),
        kv_start_page=torch.tensor(start, **i32),
        kv_lens=torch.tensor(kv_lens, **i32),
        cu_q=cu,
        max_q=max(q_lens, default=0),
    )


def reference(a, causal, ps, kv_ranges=None):
    return torch_ops.paged_attention(
        a["q"].double(),
        a["k_cache"].double(),
        a["v_cache"].double(),
        a["page_table"],
        a["kv_start_page"],
        a["kv_lens"],
        a["cu_q"],
        a["max_q"],
        causal,
        SCALE,
        ps,
        kv_ranges,
    )


def run(a, causal, ps, num_splits=None, out=None, kv_ranges=None):
    a = {k: _dev(v) for k, v in a.items()}  # the kernel runs where the GPU is, if any
    out = torch.full_like(a["q"], float("nan")) if out is None else _dev(out)  # poison
    kv_ranges = _dev(kv_ranges)
    return paged_attention(
        a["q"],
        a["k_cache"],
        a["v_cache"],
        a["page_table"],
        a["kv_start_page"],
        a["kv_lens"],
        a["cu_q"],
        a["max_q"],
        causal,
        SCALE,
        ps,
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


@pytest.mark.parametrize("ps", [16, 64, 128])
@pytest.mark.parametrize("mode", ["decode", "causal", "full"])
@pytest.mark.parametrize("group", [1, 2])
def test_matches_reference(ps, mode, group):
    kv_lens = [0, 1, ps + 7, 2 * ps + 3]  # empty, single key, partial last page
    q_lens = [1, 1, 1, 1] if mode == "decode" else [2, 3, 5, 4]  # request 1: rows before key 0
    a = make_paged(kv_lens, q_lens, ps, hq=2 * group, hkv=2, d=32, seed=ps + group)
    causal = mode != "full"
    ref = reference(a, causal, ps)
    check(run(a, causal, ps, num_splits=1 + 2 * (group - 1)), ref)  # group 2: split-KV path


@pytest.mark.parametrize("ps", [16, 128])
def test_encoder_like_decode(ps):
    """Whisper cross-attention at decode: 1500 keys (1500 % 128 = 92), a text-only request."""
    a = make_paged([1500, 0, 1500], [1, 1, 1], ps, hq=2, hkv=1, d=64, seed=7)
    check(run(a, False, ps, num_splits=4), reference(a, False, ps))


@pytest.mark.parametrize("d", [16, 80, 128])
def test_head_dims(d):
    a = make_paged([0, 19, 40], [3, 2, 4], 16, hq=6, hkv=2, d=d, seed=d)
    check(run(a, True, 16), reference(a, True, 16))


def test_large_page_read_in_slices():
    """fp32, head_dim 128: a 256-slot page is read in aligned slices (16 keys per step)."""
    a = make_paged([300, 0, 513], [2, 1, 3], 256, hq=2, hkv=1, d=128, seed=2)
    check(run(a, True, 256, num_splits=2), reference(a, True, 256))


def test_group_not_power_of_two_and_all_empty():
    a = make_paged([33, 5], [4, 1], 32, hq=10, hkv=2, d=32, seed=3)
    check(run(a, True, 32, num_splits=2), reference(a, True, 32))
    e = make_paged([0, 0], [1, 1], 16, hq=2, hkv=1, d=32, seed=4)
    out = run(e, False, 16, num_splits=2)
    assert (out == 0).all()


def test_kv_ranges():
    """Per-token key windows (Mllama cross-attention masks), including empty windows."""
    a = make_paged([70, 0, 40], [3, 1, 2], 16, hq=4, hkv=2, d=32, seed=9)
    rng = torch.tensor([[0, 70], [20, 37], [65, 200], [0, 0], [5, 6], [30, 10]], dtype=torch.int32)
    ref = reference(a, False, 16, rng)
    for splits in (1, 2):
        check(run(a, False, 16, num_splits=splits, kv_ranges=rng), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    a = make_paged([0, 50, 130], [2, 3, 1], 64, hq=4, hkv=2, d=64, dtype=dtype, seed=11)
    out = run(a, True, 64)
    assert out.dtype == dtype
    check(out, reference(a, True, 64), tol=2e-2)


@pytest.mark.parametrize("ps", [16, 128, 256])
def test_decode_self_attention_tiles(ps):
    """Whisper's decode self-attention (bf16, one query a row, no GQA) runs 64-key blocks
    whatever the page size (a 128- or 256-slot page in slices, 16-slot pages four a block):
    the same values as the float64 reference, with split-KV too."""
    a = make_paged([0, 1, 63, 64, ps + 5, 2 * ps + 70], [1] * 6, ps, hq=3, hkv=3, d=64,
                   dtype=torch.bfloat16, seed=ps + 1)
    ref = reference(a, True, ps)
    for splits in (None, 3):
        check(run(a, True, ps, num_splits=splits), ref, tol=2e-2)


def test_strided_q_and_out():
    a = make_paged([10, 70], [3, 2], 16, hq=4, hkv=2, d=32, seed=5)
    qkv = torch.randn(a["q"].shape[0], 8, 32)
    qkv[:, :4] = a["q"]
    a["q"] = qkv[:, :4]  # non-contiguous view, like a fused qkv projection
    big = torch.full((a["q"].shape[0], 6, 32), float("nan"))
    out = run(a, True, 16, out=big[:, 1:5])
    check(out, reference(a, True, 16))
    if DEV == "cpu":  # on a GPU, run() hands the kernel a device copy of ``big``
        assert out.data_ptr() == big[:, 1:5].data_ptr()
    assert big[:, 0].isnan().all() and big[:, 5].isnan().all()


def test_empty_batch():
    a = make_paged([], [], 16, hq=2, hkv=2, d=32)
    assert run(a, False, 16).shape == (0, 2, 32)


def test_page_size_support():
    assert supported_page_sizes() == SUPPORTED_PAGE_SIZES == (16, 32, 64, 128, 256)
    assert supported_page_sizes((128, 64)) == (64, 128)  # Intel XPU flash attention
    with pytest.raises(ValueError, match="subset"):
        supported_page_sizes((64, 100))
    with pytest.raises(ValueError, match="page size 32"):
        check_page_size(32, restrict=(64, 128))
    check_page_size(128, restrict=(64, 128))
    a = make_paged([5], [1], 16, hq=2, hkv=2, d=32)
    for ps in (1, 8, 24, 512):
        with pytest.raises(ValueError, match=f"page size {ps} is not supported"):
            run(a, False, ps)


def test_input_validation():
    a = make_paged([5, 9], [1, 2], 16, hq=4, hkv=2, d=32)

    def bad(match, **kw):
        b = {**a, **kw}
        with pytest.raises(ValueError, match=match):
            run(b, False, 16)

    bad("multiple of kv heads", q=torch.randn(3, 3, 32))
    bad("head_dim mismatch", q=torch.randn(3, 4, 16))
    bad("dtype mismatch", q=a["q"].double())
    bad("dtype", q=a["q"].double(), k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double())
    bad("k_cache", v_cache=a["v_cache"][:-16])
    bad("page_table", page_table=a["page_table"][:1])
    bad("int32 or int64", kv_lens=a["kv_lens"].float())
    bad("cu_q", cu_q=a["cu_q"][:-1])
    bad("max_q", max_q=-1)
    bad("multiple of page_size", k_cache=a["k_cache"][:-1], v_cache=a["v_cache"][:-1])


def test_fp8_cache_is_read_in_q_dtype():
    """An fp8 (e4m3, scale 1) KV cache (``--kv-cache-dtype fp8``) read through the page table:
    cast to q's dtype on load; the reference reads the same e4m3 values in float64."""
    a = make_paged([0, 50, 130], [2, 3, 1], 16, hq=4, hkv=2, d=32, seed=12)
    a["k_cache"] = a["k_cache"].to(torch.float8_e4m3fn)
    a["v_cache"] = a["v_cache"].to(torch.float8_e4m3fn)
    check(run(a, True, 16), reference(a, True, 16))
