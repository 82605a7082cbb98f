"""Names for the compiled CPU step's graphs that are the same in every process, so inductor's
on-disk cache serves a new process (:mod:`edserve.engine.cpu_compile`).

``aot_compile`` names each graph it makes ``__compiled_fn_<n>_<uuid4>`` (dynamo's ``unique_id``
with a uuid: names unique across processes, for precompiled packages). The name is part of
AOTAutograd's cache key, and an aot-compiled graph's inductor code is bundled in that cache
entry, so every new process missed the cache and compiled each graph from scratch:
``--cpu-compile on`` over 10 short files took ~50 s against ~15 s with the names below (2-core
Xeon, wave 31). While a runner compiles, dynamo's graph name is instead one the runner chooses
(unique in the process: the runner's index and the variant), which is the same in every process
that builds the same engine and compiles its variants alike. A name only keys the cache: the
key also holds the graph's code and every constant in it, so equal names never share a graph
of other content.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_PREFIX = "__compiled_fn"
_lock = threading.Lock()  # one patched compile at a time in a process


@contextlib.contextmanager
def stable_graph_name(name: str) -> Iterator[None]:
    """While the block compiles, dynamo names its graph ``__compiled_fn_<name>`` (a second
    graph in the same compile ``..._<name>_1``, and so on). Without the hook this torch version
    offers (``torch._dynamo.output_graph.unique_id``) names keep their uuid: the cache misses,
    nothing else changes."""
    from torch._dynamo import output_graph

    with _lock:
        original = getattr(output_graph, "unique_id", None)
        if original is None:
            yield
            return
        made = [0]

        def unique_id(prefix: str, with_uuid: bool = False) -> str:
            if prefix != _PREFIX:
                return original(prefix, with_uuid)
            made[0] += 1
            return f"{_PREFIX}_{name}" + ("" if made[0] == 1 else f"_{made[0] - 1}")

        output_graph.unique_id = unique_id
        try:
            yield
        finally:
            output_graph.unique_id = original
