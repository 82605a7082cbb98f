"""Shared test setup: Triton kernels run under the CPU interpreter when there is no GPU, and
the KV allocators validate every call (``EDSERVE_DEBUG_CHECKS=1``, off in production).

``EDSERVE_TEST_THREADS`` sets torch's CPU threads (default: up to 4); on a loaded machine, 1
avoids thread oversubscription stalls.
"""

import os

os.environ.setdefault("EDSERVE_DEBUG_CHECKS", "1")  # allocators validate every call in tests

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_threads = int(os.environ.get("EDSERVE_TEST_THREADS", "0")) or max(1, min(4, os.cpu_count() or 1))
torch.set_num_threads(_threads)
os.environ.setdefault("EDSERVE_THREADS", str(_threads))  # engines keep the test thread count
