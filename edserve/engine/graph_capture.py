"""One CUDA-graph capture of a function, on a side stream (the pattern every small graph of the
engine uses: the beam choice, the sampling, a beam step's post-sampling work).

:func:`capture` runs ``before`` (a warm-up, not captured) and then captures ``body`` on a fresh
stream that first waits for the current one; the current stream waits for it afterwards. The
capture is ``thread_local``: other threads (audio workers, the server, the features thread) may
use CUDA meanwhile. Capturing runs nothing: :meth:`torch.cuda.CUDAGraph.replay` does.
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
        with torch.cuda.graph(graph, pool=pool, stream=stream,
                              capture_error_mode="thread_local"):
            out = body()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out
