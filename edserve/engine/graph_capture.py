"""One CUDA-graph capture of a function, on a side stream (the pattern every small graph of the
engine uses: the beam choice, the sampling, a beam step's post-sampling work).

:func:`capture` runs ``before`` (a warm-up, not captured) and then captures ``body`` on a fresh
stream that first waits for the current one; the current stream waits for it afterwards. The
capture is ``thread_local``: other threads (audio workers, the server, the features thread) may
use CUDA meanwhile. Capturing runs nothing: :meth:`torch.cuda.CUDAGraph.replay` does.

These captures happen while serving (a sampling graph on the first step of each new batch size
and filter chain), so :func:`capture` calls ``capture_begin`` / ``capture_end`` itself instead of
entering ``torch.cuda.graph``, whose set-up is for start-up captures: it synchronizes the
device (the host then waits for the step in flight: overlap lost), empties the device
allocator's cache and the page-locked host allocator's cache (so the next requests' staging
pays ``cudaHostAlloc`` again). Measured on an H200 serving 32 clients, a fresh server spent
9 % of its stepping thread in those captures, 8 % of it in that synchronize. Nothing here
needs them: the capture runs on its own stream after the current one's work, and its memory
comes from the graph's pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(body: Callable[[], Any], device: torch.device, pool: Any = None,
            before: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, what body returned)``; ``pool``: a graph memory pool to share (None: the
    graph's own)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        if before is not None:
            before()
        graph.capture_begin(*(() if pool is None else (pool,)),
                            capture_error_mode="thread_local")
        try:
            out = body()
        finally:  # as torch.cuda.graph's exit: the capture ends even when body raised
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out
