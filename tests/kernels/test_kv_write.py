"""The Triton KV row-copy kernel (CPU interpreter without CUDA) writes exactly what
``index_put`` writes: strided sources (a layer's k/v inside the fused cross-K/V GEMM output),
float32 and bfloat16, int32/int64 slots, widths that are not a power of two; and KVPool.set_kv
routes every write (an encoder's 1500 rows, a decode step's one per request) through it with the
same pool contents as the index_put path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.kv_write import write_kv_rows  # noqa: E402
from edserve.mem_cache.kv_pool import KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors


@pytest.mark.parametrize("heads,dim,dtype,loc_dtype", [
    (4, 16, torch.float32, torch.int64),  # width 64
    (5, 8, torch.float32, torch.int32),  # width 40
    (3, 100, torch.bfloat16, torch.int64),  # width 300: two column blocks
])
def test_rows_equal_index_put(heads, dim, dtype, loc_dtype):
    gen = torch.Generator().manual_seed(heads * dim)
    slots, n, layers = 400, 150, 3
    # the cross-K/V GEMM output [n, layers, 2, H, D]: k and v of layer 1 are strided views
    y = torch.randn(n, layers, 2, heads, dim, generator=gen).to(dtype).to(DEVICE)
    k, v = y[:, 1, 0], y[:, 1, 1]
    loc = torch.randperm(slots, generator=gen)[:n].to(loc_dtype).to(DEVICE)
    k_dst = torch.randn(slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    v_dst = torch.randn(slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref = k_dst.clone(), v_dst.clone()
    k_ref[loc.long()] = k
    v_ref[loc.long()] = v
    write_kv_rows(k_dst, v_dst, loc, k, v)
    assert torch.equal(k_dst, k_ref) and torch.equal(v_dst, v_ref)
    write_kv_rows(k_dst, v_dst, loc[:0], k[:0], v[:0])  # empty: nothing launched or written
    assert torch.equal(k_dst, k_ref)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_pool_writes_use_the_kernel_and_equal_index_put(page_size, monkeypatch):
    from edserve.kernels import kv_write

    launches = []
    real = kv_write.write_kv_rows
    monkeypatch.setattr(kv_write, "write_kv_rows",
                        lambda *a: launches.append(a[2].shape[0]) or real(*a))
    n = 549  # an encoder's cross K/V ending mid-page
    pools = [KVPool(2048, page_size, 2, 2, 8, torch.float32, DEVICE, write_kernel=w)
             for w in (True, False)]
    assert pools[0].write_kernel and not pools[1].write_kernel
    gen = torch.Generator().manual_seed(page_size)
    y = torch.randn(n, 2, 2, 2, 8, generator=gen).to(DEVICE)  # [n, layers, k|v, H, D]
    start = page_size + 3 * page_size  # page 4 onwards, contiguous slots
    loc = torch.arange(start, start + n, device=DEVICE)
    short = torch.tensor([2, 2047], device=DEVICE)  # a decode step's rows, outside loc
    for pool in pools:
        for layer in range(2):
            pool.set_kv(layer, loc, y[:, layer, 0], y[:, layer, 1])
            pool.set_kv(layer, short, y[:2, layer, 1], y[:2, layer, 0])
    assert launches == [n, 2, n, 2]  # the kernel pool only, long and short writes alike
    for a, b in zip(pools[0].k_buffers + pools[0].v_buffers,
                    pools[1].k_buffers + pools[1].v_buffers, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(pools[0].k_buffers[1][loc], y[:, 1, 0])


def test_fp8_pool_keeps_the_saturating_torch_cast():
    pool = KVPool(1024, 1, 1, 1, 4, torch.float8_e4m3fn, DEVICE, write_kernel=True)
    assert not pool.write_kernel
