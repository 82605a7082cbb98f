"""Stable graph names (edserve.engine.graph_names): an aot-compiled graph made again under the
same name (as a new process would) is served from inductor's disk cache; under dynamo's own
uuid name it is compiled again."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from edserve.engine.graph_names import stable_graph_name


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ w, dim=-1).cumsum(-1)


def _aot(x, w):
    return torch.compile(_step, backend="inductor", dynamic=False,
                         fullgraph=True).aot_compile(((x, w), {}))


def test_same_name_hits_the_disk_cache_and_uuid_names_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    want = _step(x, w)
    counters.clear()
    with stable_graph_name("edserve_test_a"):
        first = _aot(x, w)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    torch._dynamo.reset()  # as a new process: nothing compiled in memory, nor the graph
    del globals()["__compiled_fn_edserve_test_a"]  # installed in this module by dynamo
    with stable_graph_name("edserve_test_a"):
        again = _aot(x, w)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    torch._dynamo.reset()
    _aot(x, w)  # dynamo's name with a uuid: a new cache key
    assert counters["aot_autograd"]["autograd_cache_miss"] == 2
    for fn in (first, again):
        torch.testing.assert_close(fn(x, w), want)


def test_the_hook_is_restored_and_other_names_untouched():
    from torch._dynamo import output_graph

    original = output_graph.unique_id
    with stable_graph_name("edserve_test_b"):
        assert output_graph.unique_id("__compiled_fn", True) == "__compiled_fn_edserve_test_b"
        assert output_graph.unique_id("__compiled_fn", True) == "__compiled_fn_edserve_test_b_1"
        assert output_graph.unique_id("__other").startswith("__other_")
    assert output_graph.unique_id is original
