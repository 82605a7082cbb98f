"""``choose_num_splits``: the split-KV factor the attention kernels take from shapes alone."""

from __future__ import annotations

import pytest
import torch

from edserve.kernels import split_kv

CUDA = torch.device("cuda")  # a device object only: the SM count is patched


@pytest.fixture(autouse=True)
def h200_sms(monkeypatch):
    monkeypatch.setattr(split_kv, "_sm_count", lambda device: 132)


def test_a_full_grid_splits_long_cross_ranges_but_not_self_attention():
    """72 rows x 8 kv heads under a graph's whole-row table (8192 keys of bound): the
    cross-attention's uneven image rows split 8 ways; the self-attention's few decoder keys
    do not (each split past the first would be empty)."""
    assert split_kv.choose_num_splits(576, 8192, 128, CUDA) == split_kv.LONG_KV_SPLITS
    assert split_kv.choose_num_splits(576, 8192, 128, CUDA, causal=True) == 1
    assert split_kv.choose_num_splits(576, 2048, 128, CUDA) == 1  # below LONG_KV


def test_an_underfilled_grid_splits_either_way():
    for causal in (False, True):
        n = split_kv.choose_num_splits(8, 8192, 128, CUDA, causal=causal)
        assert 1 < n <= split_kv.MAX_SPLITS
        assert n == min(-(-2 * 132 // 8), 8192 // 128 // 4)


def test_short_ranges_and_the_cpu_never_split():
    assert split_kv.choose_num_splits(8, 256, 128, CUDA) == 1  # < 4 key blocks per split
    assert split_kv.choose_num_splits(8, 8192, 128, torch.device("cpu")) == 1
    assert split_kv.choose_num_splits(0, 8192, 128, CUDA) == 1
