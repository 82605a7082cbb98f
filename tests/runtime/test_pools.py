"""The composition root's sizing: the running limit (auto on CPU and CUDA, explicit), the pools
it builds, and what the start-up log says."""

from __future__ import annotations

import logging

import pytest
import torch

from edserve.config import CPU_RUNNING_DEFAULT, EngineConfig
from edserve.mem_cache import KVCacheConfig, plan_kv_cache
from edserve.runtime import build_engine
from edserve.runtime.pools import auto_running


def _plan(num_slots_budget_tokens: int, context_len: int = 1948, page_size: int = 128):
    return plan_kv_cache(KVCacheConfig(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=page_size,
        max_running_requests=256, context_len=context_len,
        max_total_tokens=num_slots_budget_tokens))


def test_auto_running_fits_worst_case_rows_under_the_graph_cap():
    plan = _plan(100_000)  # 100_000 // 128 pages -> 99_968 slots; rows of 2048 columns
    sized, reason = auto_running(plan, cap=256)
    assert plan.max_context_len == 2048
    assert sized.num_rows == 99_968 // 2048 == 48
    assert "48" in reason and "2048" in reason and "256" in reason
    capped, reason = auto_running(_plan(10_000_000), cap=256)
    assert capped.num_rows == 256 and "CUDA-graph cap 256" in reason
    # every auto-sized row fits at its longest: rows x columns <= slots
    assert sized.num_rows * sized.max_context_len <= sized.num_slots


def test_cpu_auto_keeps_the_small_default(caplog, random_whisper):
    with caplog.at_level(logging.INFO, logger="edserve"):
        engine = build_engine(EngineConfig(model=str(random_whisper), device="cpu"))
    assert engine.config.max_running_requests == CPU_RUNNING_DEFAULT
    assert engine.pools.req_to_token_pool.size == CPU_RUNNING_DEFAULT
    assert "auto on CPU: 16" in caplog.text


def test_explicit_limit_is_kept_and_reported(caplog, random_whisper):
    with caplog.at_level(logging.INFO, logger="edserve"):
        engine = build_engine(EngineConfig(model=str(random_whisper), device="cpu",
                                           max_running_requests=3))
    assert engine.config.max_running_requests == 3 == engine.pools.req_to_token_pool.size
    assert "--max-running-requests 3" in caplog.text


def test_flag_parses_auto_and_integers():
    import argparse

    from edserve.config_args import add_config_args, config_from_args

    p = argparse.ArgumentParser()
    add_config_args(p)
    assert config_from_args(p.parse_args([])).max_running_requests is None
    assert config_from_args(p.parse_args(["--max-running-requests", "auto"])) \
        .max_running_requests is None
    assert config_from_args(p.parse_args(["--max-running-requests", "7"])) \
        .max_running_requests == 7
    with pytest.raises(SystemExit):
        p.parse_args(["--max-running-requests", "many"])
    assert "auto" in p.format_help() and "worst case" in p.format_help()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_sizes_from_the_pool(random_whisper):
    engine = build_engine(EngineConfig(model=str(random_whisper), device="cuda"))
    rows = engine.config.max_running_requests
    assert rows > CPU_RUNNING_DEFAULT and rows <= 256
    assert engine.runner.graph_runner is None or engine.runner.graph_runner.max_bs == rows


def test_encoder_graphs_default_to_small_batches_where_decode_graphs_run():
    from edserve.runtime.build import ENCODER_GRAPH_MAX_BS_AUTO, encoder_graph_max_bs
    from edserve.runtime.settings import RuntimeSettings

    def settings(device: str, ops: str = "triton") -> RuntimeSettings:
        return RuntimeSettings(torch.device(device), torch.bfloat16, None, ops, 128,
                               torch.bfloat16)

    gpu, cpu = settings("cuda"), settings("cpu", "torch")
    base = EngineConfig(encoder_kv="flat")
    assert encoder_graph_max_bs(base, gpu, whisper=True) == ENCODER_GRAPH_MAX_BS_AUTO == 4
    fp8 = base.replace(encoder_dtype="fp8")  # its host launches need the graphs most
    assert encoder_graph_max_bs(fp8, gpu, whisper=True) == 4
    for config, s, whisper in ((base, cpu, True), (base, gpu, False),
                               (base.replace(cuda_graph=False), gpu, True),
                               (base.replace(encoder_kv="ragged"), gpu, True),
                               (base.replace(compile_encoder=True), gpu, True),
                               (base.replace(tensor_parallel_size=2), gpu, True)):
        assert encoder_graph_max_bs(config, s, whisper) == 0, config
    assert encoder_graph_max_bs(base.replace(encoder_cuda_graph_max_bs=0), gpu, True) == 0
    assert encoder_graph_max_bs(base.replace(encoder_cuda_graph_max_bs=8), cpu, True) == 8


def test_mixed_steps_admit_four_whisper_windows_on_cuda_the_whole_budget_elsewhere():
    from types import SimpleNamespace

    from edserve.runtime.build import (
        DEFAULT_PREFILL_TOKENS,
        MIXED_PROMPT_TOKENS,
        MIXED_WINDOWS_AUTO,
        prefill_budgets,
    )
    from edserve.runtime.settings import RuntimeSettings

    def settings(device: str) -> RuntimeSettings:
        return RuntimeSettings(torch.device(device), torch.float32, None, "torch", 128,
                               torch.float32)

    whisper = SimpleNamespace(model_type="whisper", max_encoder_len=1500)
    mllama = SimpleNamespace(model_type="mllama", max_encoder_len=6404)
    flat = SimpleNamespace(encoder_region=lambda n: n)  # the flat strategy's region
    base, row = EngineConfig(), 1948
    window = 1500 + MIXED_PROMPT_TOKENS
    assert prefill_budgets(base, settings("cuda"), whisper, flat, row) \
        == (DEFAULT_PREFILL_TOKENS[True], MIXED_WINDOWS_AUTO * window) == (262144, 6512)
    assert prefill_budgets(base, settings("cpu"), whisper, flat, row) == (65536, 65536)
    assert prefill_budgets(base, settings("cuda"), mllama, flat, 14596) == (262144, 262144)
    given = base.replace(max_prefill_tokens=3000, max_mixed_prefill_tokens=100)
    assert prefill_budgets(given, settings("cuda"), whisper, flat, row) == (3000, row)  # >= a row
    assert prefill_budgets(base.replace(max_mixed_prefill_tokens=10 ** 6), settings("cuda"),
                           whisper, flat, row) == (262144, 262144)  # never above the budget
