"""The Triton KV pair-copy kernel (CPU interpreter without CUDA) copies exactly what
``index_put`` copies for non-overlapping pairs, skips ``src == dst`` pairs (the fixed-shape
padding of beam reorders), is a bit copy for every pool dtype (float8 included), and
``KVPool.copy_slots`` routes through it with the same pool contents as the index path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edserve.kernels.kv_copy import copy_kv_rows  # noqa: E402
from edserve.mem_cache.kv_pool import KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors


def _pairs(gen, slots: int, n: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` non-overlapping pairs (distinct slots) and ``pad`` padding pairs ``0 -> 0``,
    shuffled together."""
    perm = torch.randperm(slots - 1, generator=gen)[:2 * n] + 1
    src = torch.cat([perm[:n], torch.zeros(pad, dtype=torch.int64)])
    dst = torch.cat([perm[n:], torch.zeros(pad, dtype=torch.int64)])
    order = torch.randperm(n + pad, generator=gen)
    return src[order].to(DEVICE), dst[order].to(DEVICE)


@pytest.mark.parametrize("heads,dim,dtype", [
    (4, 16, torch.float32),  # width 64
    (5, 8, torch.bfloat16),  # width 40: not a power of two
    (3, 100, torch.float16),  # width 300: two column blocks on the GPU
    (2, 8, torch.float8_e4m3fn),  # a bit copy: no cast
])
def test_pairs_equal_index_put_and_padding_moves_nothing(heads, dim, dtype):
    gen = torch.Generator().manual_seed(heads * dim)
    slots = 300
    k = torch.randn(slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    k[0], v[0] = 7.0, -7.0  # the padding slot keeps its contents
    src, dst = _pairs(gen, slots, 90, 200)
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[dst] = k_ref[src]
    v_ref[dst] = v_ref[src]
    copy_kv_rows(k, v, src, dst)
    assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
    same = torch.tensor([5, 6], device=DEVICE)
    before = k.clone()
    copy_kv_rows(k, v, same, same)  # self pairs: no-ops
    copy_kv_rows(k, v, same[:0], same[:0])  # empty: nothing launched
    assert torch.equal(k.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_copies_use_the_kernel_and_equal_the_index_path(page_size):
    pools = [KVPool(1024, page_size, 2, 2, 8, torch.bfloat16, DEVICE, write_kernel=w)
             for w in (True, False)]
    assert pools[0].copy_kernel and not pools[1].copy_kernel
    gen = torch.Generator().manual_seed(page_size)
    loc = torch.arange(page_size, 1024 + page_size, device=DEVICE)
    y = torch.randn(1024, 2, 2, 2, 8, generator=gen).to(DEVICE)  # [slots, layers, k|v, H, D]
    src, dst = _pairs(gen, 1024 + page_size, 100, 50)
    for pool in pools:
        for layer in range(2):
            pool.set_kv(layer, loc, y[:, layer, 0], y[:, layer, 1])
        pool.copy_slots(src, dst)
    for a, b in zip(pools[0].k_buffers + pools[0].v_buffers,
                    pools[1].k_buffers + pools[1].v_buffers, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(pools[0].k_buffers[1][dst], pools[0].k_buffers[1][src])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_beam_reorder_shaped_copy_on_cuda():
    """A large-v3 layer's shape (20 heads x 64, bfloat16) and a beam reorder's index (320
    rows x 127 tail pairs, ~10 % real): the kernel equals the index path, without a sync."""
    from cuda_syncs import count_syncs

    gen = torch.Generator().manual_seed(0)
    slots = 64 * 1024
    k = torch.randn(slots, 20, 64, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(slots, 20, 64, generator=gen).to(torch.bfloat16).cuda()
    src, dst = _pairs(gen, slots, 4000, 320 * 127 - 4000)
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[dst] = k_ref[src]
    v_ref[dst] = v_ref[src]
    copy_kv_rows(k, v, src, dst)  # compiles; the pairs do not overlap: copying twice is once
    assert count_syncs(lambda: copy_kv_rows(k, v, src, dst)) == 0
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
