import logging
import re

import pytest
import torch

from edserve.mem_cache import IndexOutOfRangeError, KVPool


def make_pool(**kw) -> KVPool:
    args = dict(num_slots=16, page_size=4, num_layers=2, num_kv_heads=3, head_dim=5)
    args.update(kw)
    return KVPool(**args)


def test_buffer_shapes_and_byte_counts():
    pool = make_pool(dtype=torch.float16)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 2
    for k, v in (pool.get_kv(0), pool.get_kv(1)):
        assert k.shape == v.shape == (16 + 4, 3, 5)  # first page is padding
        assert k.dtype == v.dtype == torch.float16
    assert pool.num_slots == 16 and pool.page_size == 4
    assert pool.bytes_per_token == 2 * 2 * 3 * 5 * 2
    assert pool.k_bytes == pool.v_bytes == 2 * 20 * 3 * 5 * 2


def test_logs_one_startup_line(caplog):
    with caplog.at_level(logging.INFO, logger="edserve"):
        make_pool(num_slots=1024, page_size=16, dtype=torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if r.name == "edserve"]
    assert len(lines) == 1
    assert re.fullmatch(
        r"KV cache allocated\. dtype: torch\.bfloat16, #tokens: 1024, "
        r"K size: \d+\.\d\d GB, V size: \d+\.\d\d GB",
        lines[0],
    )


def test_set_kv_then_get_kv_round_trip_with_cast():
    pool = make_pool(dtype=torch.bfloat16)
    loc = torch.tensor([4, 9, 19])
    k = torch.randn(3, 3, 5)
    v = torch.randn(3, 3, 5)
    pool.set_kv(1, loc, k, v)
    kb, vb = pool.get_kv(1)
    assert torch.equal(kb[loc], k.to(torch.bfloat16))
    assert torch.equal(vb[loc], v.to(torch.bfloat16))
    assert kb[[0, 5, 18]].abs().sum() == 0  # untouched slots stay zero
    assert pool.get_kv(0)[0].abs().sum() == 0  # other layer untouched
    pool.set_kv(0, torch.tensor([0], dtype=torch.int32), k[:1], v[:1])  # padding slot is valid


def test_set_kv_misuse_raises_and_writes_nothing():
    pool = make_pool()
    k = torch.ones(2, 3, 5)
    cases = [
        (ValueError, "shape", lambda: pool.set_kv(0, torch.tensor([4, 5]), k[:, :2], k)),
        (ValueError, "shape", lambda: pool.set_kv(0, torch.tensor([4, 5]), k, k[:1])),
        (ValueError, "floating", lambda: pool.set_kv(0, torch.tensor([4, 5]), k.long(), k)),
        (ValueError, "integer", lambda: pool.set_kv(0, torch.tensor([4.0, 5.0]), k, k)),
        (ValueError, "integer", lambda: pool.set_kv(0, torch.tensor([[4, 5]]), k, k)),
        (IndexOutOfRangeError, "0..19", lambda: pool.set_kv(0, torch.tensor([4, 20]), k, k)),
        (IndexOutOfRangeError, "0..19", lambda: pool.set_kv(0, torch.tensor([-1, 5]), k, k)),
        (IndexOutOfRangeError, "layer", lambda: pool.set_kv(2, torch.tensor([4, 5]), k, k)),
        (IndexOutOfRangeError, "layer", lambda: pool.get_kv(-1)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert all(b.abs().sum() == 0 for b in pool.k_buffers + pool.v_buffers)


def test_constructor_validation():
    with pytest.raises(ValueError, match="multiple"):
        make_pool(num_slots=10, page_size=4)
    with pytest.raises(ValueError, match="head_dim"):
        make_pool(head_dim=0)


def test_fp8_pool_saturates_and_stores_e4m3():
    pool = KVPool(8, 1, 1, 1, 4, torch.float8_e4m3fn, "cpu")
    k = torch.tensor([[[1000.0, -1e6, 0.3, 1.0]]])  # [1 slot, 1 head, 4]
    pool.set_kv(0, torch.tensor([3]), k, -k)
    kb, vb = pool.get_kv(0)
    assert kb.dtype == torch.float8_e4m3fn
    assert kb[3].float().tolist() == [[448.0, -448.0, 0.3125, 1.0]]  # 0.3 -> nearest e4m3
    assert vb[3].float().tolist() == [[-448.0, 448.0, -0.3125, -1.0]]
