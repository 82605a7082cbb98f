"""``--tensor-parallel-size 2`` on two GPUs (NCCL, Triton kernels): the CPU module's checks
(tokens equal TP 1's, every rank's KV shard equals the unsplit pool's heads, the follower ran
every call, beam copies mirrored). Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch

import edserve.parallel
from tests.parallel.test_tp_engine import check_tp2_equals_tp1
from tests.parallel.tiny_mllama import tiny_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.fixture(scope="module")
def checkpoint():
    yield tiny_checkpoint()
    edserve.parallel.shutdown()


@pytest.mark.parametrize("strategy,page_size", [("aligned", 128), ("flat", 128), ("ragged", 1),
                                                ("flat", 16)])
def test_tp2_tokens_equal_tp1_on_gpus(checkpoint, strategy, page_size):
    check_tp2_equals_tp1(checkpoint, strategy, page_size, "cuda")
