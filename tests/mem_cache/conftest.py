"""mem_cache tests use tiny tensors: intra-op threads only add wake-up latency (which on a
loaded 2-core machine turned 3 us ops into 8 ms ones), so run them single-threaded."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
