import dataclasses

import pytest
import torch

from edserve.mem_cache import KVCacheConfig, KVPool, PoolTooSmallError, plan_kv_cache

GB = 1024**3


def cfg(**kw) -> KVCacheConfig:
    args = dict(
        num_layers=4,
        num_kv_heads=6,
        head_dim=64,
        dtype=torch.float16,
        page_size=16,
        max_running_requests=8,
        context_len=1948,
    )
    args.update(kw)
    return KVCacheConfig(**args)


def test_slots_from_budget_floored_to_whole_pages():
    c = cfg(memory_bytes=2 * GB, mem_fraction_static=0.5, used_bytes=100_000_000)
    plan = plan_kv_cache(c)
    bpt = 2 * 4 * 6 * 64 * 2
    budget = int(2 * GB * 0.5) - 100_000_000
    assert plan.bytes_per_token == bpt == c.bytes_per_token
    assert plan.num_slots % 16 == 0
    assert plan.num_slots == (budget // bpt - 16) // 16 * 16
    assert plan.total_bytes == (plan.num_slots + 16) * bpt <= budget
    assert plan.max_context_len == 1952  # 1948 + 4, already a multiple of 16
    assert plan.num_rows == 8


def test_pool_built_from_plan_matches_total_bytes():
    c = cfg(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        page_size=4,
        context_len=10,
        extra_cols=0,
        memory_bytes=8000,
    )
    plan = plan_kv_cache(c)
    pool = KVPool(plan.num_slots, 4, 1, 1, 8, torch.float32)
    assert pool.k_bytes + pool.v_bytes == plan.total_bytes <= 8000 * 0.8
    assert plan.max_context_len == 12  # 10 rounded up to pages of 4


def test_max_total_tokens_caps_and_is_floored():
    plan = plan_kv_cache(cfg(memory_bytes=80 * GB, max_total_tokens=5000))
    assert plan.num_slots == 4992  # 5000 floored to pages of 16
    plan = plan_kv_cache(cfg(memory_bytes=None, max_total_tokens=4001, page_size=1))
    assert plan.num_slots == 4001
    assert plan.num_rows == 8


def test_rows_limited_by_slots():
    plan = plan_kv_cache(
        cfg(max_total_tokens=2000, max_running_requests=4096, page_size=1, context_len=100)
    )
    assert plan.num_rows == 1000  # num_slots // 2


def test_needs_a_budget():
    with pytest.raises(ValueError, match="memory_bytes or max_total_tokens"):
        cfg()


def test_pool_too_small_when_one_request_does_not_fit():
    with pytest.raises(PoolTooSmallError, match=r"1936 tokens.*max_context_len=1952"):
        plan_kv_cache(cfg(max_total_tokens=1950))
    bpt = 2 * 4 * 6 * 64 * 2
    with pytest.raises(PoolTooSmallError, match="max_context_len=1952"):
        plan_kv_cache(cfg(memory_bytes=1000 * bpt, mem_fraction_static=1.0))
    with pytest.raises(PoolTooSmallError, match="no memory left"):
        plan_kv_cache(cfg(memory_bytes=GB, used_bytes=GB))
    # exactly one request fits
    plan = plan_kv_cache(cfg(max_total_tokens=1952))
    assert plan.num_slots == 1952 and plan.num_rows == 8


def test_config_is_frozen_and_validated():
    c = cfg(max_total_tokens=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 32
    with pytest.raises(ValueError):
        cfg(max_total_tokens=4096, mem_fraction_static=0.0)
    with pytest.raises(ValueError):
        cfg(max_total_tokens=4096, page_size=0)
    plan = plan_kv_cache(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_slots = 1
