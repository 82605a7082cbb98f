"""Compiled CPU decode steps (``--cpu-compile``): the same text as the eager path on the bundled
clips (greedy and beam search), and the rules that decide when a batch runs compiled.

One small random-weight Whisper, compiled once per session (two shapes: one greedy row, one beam
group of two rows); inductor's cache lives in the session's temporary folder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from whisper_fixtures import CLIPS, DATA

from edserve.audio.decode import load_audio
from edserve.engine.cpu_compile import CompiledDecodeRunner, batch_width, group_buckets
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine
from edserve.runtime.settings import CPU_COMPILE_AFTER, cpu_compile_after, resolve_settings
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe


@pytest.fixture(scope="session")
def engines(random_whisper, tmp_path_factory):
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    kw = dict(model=str(random_whisper), device="cpu", max_running_requests=2)
    return build_engine(cpu_compile="on", **kw), build_engine(cpu_compile="off", **kw)


@pytest.fixture(scope="session")
def audios():
    return [load_audio(DATA / f"{name}.wav") for name in CLIPS]


def _same_text(compiled, eager, audios, beam_size: int) -> None:
    runner = compiled.runner.graph_runner
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=beam_size, max_new_tokens=24)
    before, sampled = runner.steps, runner.sampled_steps
    for audio in audios:  # one at a time: one batch shape
        want = transcribe(eager, [audio], options=opts)[0].text
        got = transcribe(compiled, [audio], options=opts)[0].text
        assert got == want and want
    assert runner.steps - before >= len(audios) * 10  # the decode steps ran compiled
    assert runner.sampled_steps - sampled >= len(audios) * 8  # sampled inside the graphs
    assert runner.compiled == {(1, beam_size)}
    assert (1, beam_size, True) in runner.variants  # one clip: its encoder K/V read in place


def test_compiled_beam_text_equals_eager(engines, audios):
    """Inductor's C++ code (one compile: a beam group of two rows)."""
    compiled, eager = engines
    assert isinstance(compiled.runner.graph_runner, CompiledDecodeRunner)
    assert eager.runner.graph_runner is None
    _same_text(compiled, eager, audios, beam_size=2)


def test_traced_greedy_text_equals_eager(engines, audios):
    """Greedy rows through the same traced graph (dynamo's eager backend: no C++ compile)."""
    compiled, eager = engines
    saved = compiled.runner.graph_runner
    compiled.runner.graph_runner = CompiledDecodeRunner(
        compiled.model, compiled.pools, saved.max_bs, compiled.model.max_encoder_len,
        compiled.max_decoder_len, 0, None, backend="eager")
    try:
        _same_text(compiled, eager, audios, beam_size=1)
    finally:
        compiled.runner.graph_runner = saved


def test_traced_graphs_of_two_shapes_called_in_turn(engines, audios):
    """Two compiled keys (one greedy row, two greedy rows) called in turn: graphs run without
    guards, picked by the runner's own variant key, so every call must land on its own graph:
    the text equals the eager path's."""
    compiled, eager = engines
    saved = compiled.runner.graph_runner
    runner = compiled.runner.graph_runner = CompiledDecodeRunner(
        compiled.model, compiled.pools, saved.max_bs, compiled.model.max_encoder_len,
        compiled.max_decoder_len, 0, None, backend="eager")
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=1, max_new_tokens=24)
    try:
        for clips in (audios[:2], audios[:1], audios[1:3], audios[2:3]):
            got = [r.text for r in transcribe(compiled, clips, options=opts)]
            assert got == [r.text for r in transcribe(eager, clips, options=opts)]
        assert runner.compiled == {(1, 1), (2, 1)}
        assert (1, 1, True) in runner.variants  # (a region over freed, scattered slots of
        # earlier requests is gathered instead: which variants run depends on the pool's past)
    finally:
        compiled.runner.graph_runner = saved


def _batch(rows: int, runs=None, mode=ForwardMode.DECODE, ranges=None):
    return SimpleNamespace(mode=mode, batch_size=rows, cross_runs=runs, cross_kv_ranges=ranges)


def test_batch_shapes_and_compile_threshold(engines):
    runner = engines[0].runner.graph_runner
    assert group_buckets(16) == [1, 2, 4, 8, 16] and group_buckets(5) == [1, 2, 4, 5]
    assert batch_width(_batch(3)) == 1 and batch_width(_batch(6, [3, 3])) == 3
    assert batch_width(_batch(5, [3, 2])) is None
    assert runner.key(_batch(2, [2])) == (1, 2) and runner.key(_batch(2)) == (2, 1)
    assert runner.key(_batch(2, mode=ForwardMode.EXTEND)) is None
    assert runner.key(_batch(2, ranges=torch.zeros(2, 2))) is None
    assert runner.key(_batch(3)) is None  # past max_running_requests
    lazy = CompiledDecodeRunner.__new__(CompiledDecodeRunner)
    lazy.__dict__.update(runner.__dict__, compile_after=2, eager_steps={}, variants=set())
    assert [lazy.can_run(_batch(1)) for _ in range(3)] == [False, False, True]
    assert lazy.can_run(_batch(2)) is False  # counted per shape


def test_cpu_compile_setting(random_whisper):
    from edserve.config import EngineConfig

    cpu = EngineConfig(device="cpu")
    s = resolve_settings(cpu)
    assert cpu_compile_after(cpu.replace(cpu_compile="auto"), s, "whisper") == CPU_COMPILE_AFTER
    assert cpu_compile_after(cpu.replace(cpu_compile="on"), s, "whisper") == 0
    assert cpu_compile_after(cpu.replace(cpu_compile="off"), s, "whisper") is None
    assert cpu_compile_after(cpu.replace(cpu_compile="auto"), s, "mllama") is None
    ragged = cpu.replace(cpu_compile="auto", encoder_kv="ragged")
    assert cpu_compile_after(ragged, resolve_settings(ragged), "whisper") is None
    with pytest.raises(ValueError, match="flat or aligned"):
        cpu_compile_after(ragged.replace(cpu_compile="on"), resolve_settings(ragged), "whisper")
    with pytest.raises(ValueError, match="cpu-compile"):
        EngineConfig(cpu_compile="yes")
    plain = build_engine(model=str(random_whisper), device="cpu", max_running_requests=1,
                         cpu_compile="on", cpu_compile_sampling=False).runner.graph_runner
    assert plain.sampling is None  # its steps return logits: the runner samples eagerly


def test_traced_aligned_layout_text_equals_eager(random_whisper, audios):
    """The aligned layout (encoder region padded to whole pages, decoder region after it)
    read by the traced graph: same text as its eager path (greedy and a beam group)."""
    kw = dict(model=str(random_whisper), device="cpu", max_running_requests=2,
              encoder_kv="aligned", page_size="16")
    eager = build_engine(cpu_compile="off", **kw)
    traced = build_engine(cpu_compile="off", **kw)
    traced.runner.graph_runner = CompiledDecodeRunner(
        traced.model, traced.pools, 2, traced.model.max_encoder_len, traced.max_decoder_len, 0,
        None, backend="eager")
    for beam_size in (1, 2):
        opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                                 beam_size=beam_size, max_new_tokens=16)
        want = transcribe(eager, audios[:1], options=opts)[0].text
        assert transcribe(traced, audios[:1], options=opts)[0].text == want and want
    assert traced.runner.graph_runner.compiled == {(1, 1), (1, 2)}


def test_cross_anchors_only_when_every_region_is_full_and_one_run(engines):
    """Encoder regions are read in place only when every group's region fills the encoder
    columns with one run of slots (padding groups repeat the first group's); anything else (a
    shorter region, slots out of order, too many groups, the switch off) gathers."""
    from edserve.engine.cpu_compile import CROSS_VIEW_MAX_GROUPS

    runner = engines[0].runner.graph_runner
    runner._anchors.clear()  # rows 1-2 are cached from earlier requests' holds
    E = runner.encoder_cols
    table = torch.zeros(3, E + 8, dtype=torch.int32)
    table[0, :E] = torch.arange(7, 7 + E)
    table[1, :E] = torch.arange(7, 7 + E).flip(0)
    table[2, :E] = torch.arange(3000, 3000 + E)

    def batch(rows, w=1, enc_lens=None):
        rows = [r for r in rows for _ in range(w)]  # w rows per group share its region
        return SimpleNamespace(req_pool_indices=torch.tensor(rows), req_to_token=table,
                               encoder_lens_cpu=enc_lens or [E] * len(rows), batch_size=len(rows))

    one = runner._cross_anchors(batch([0], w=2), 1, 2)
    assert [a.shape for a in one] == [(7 + 2, 0)] and one[0].numel() == 0
    two = runner._cross_anchors(batch([2, 0]), 4, 1)  # two groups padded to a bucket of four
    assert [a.shape[0] - 2 for a in two] == [3000, 7, 3000, 3000]
    # no tensor twice in one call: dynamo guards on such an alias, so a graph made with one
    # pattern recompiled (an error under the unsafe stance) when a batch brought another
    assert len({id(a) for a in two}) == 4
    assert all(a._dynamo_dynamic_indices == {0} for a in two)  # each marked dynamic
    again = runner._cross_anchors(batch([2, 0]), 4, 1)  # padding anchors made once per size
    assert [id(a) for a in again] == [id(a) for a in two]
    three = runner._cross_anchors(batch([2]), 4, 1)  # three padding groups: one more made
    assert len({id(a) for a in three}) == 4 and three[1] is two[2] and three[2] is two[3]
    assert runner._cross_anchors(batch([0], enc_lens=[E - 1]), 1, 1) is None  # shorter region
    assert runner._cross_anchors(batch([0, 1]), 2, 1) is None  # one region not one run
    assert runner._cross_anchors(batch([0]), 2 * CROSS_VIEW_MAX_GROUPS, 1) is None
    runner.cross_view = False
    try:
        assert runner._cross_anchors(batch([0]), 1, 1) is None
    finally:
        runner.cross_view = True
    # a row's answer is kept for one hold of it: a new hold (alloc bumps the row's generation)
    # with a region of one run is read in place, the cached answer of the old hold is not used
    generation = runner.pools.req_to_token_pool.generation
    table[1, :E] = torch.arange(500, 500 + E)
    assert runner._cross_anchors(batch([1]), 1, 1) is None  # same hold: the kept answer
    generation[1] += 1
    try:
        assert [a.shape[0] - 2 for a in runner._cross_anchors(batch([1]), 1, 1)] == [500]
    finally:
        generation[1] -= 1
        runner._anchors.clear()


def test_marked_sizes_stay_apart_in_a_graph_called_without_guards():
    """What the in-place read relies on: two marked-dynamic sizes equal when a graph is compiled
    (a group's first slot, the decoder key count) and unequal later stay two symbols, so the
    graph, called without guards (``aot_compile``, as the runner calls its graphs), reads each
    from its own input (inductor)."""
    base = torch.arange(100.0)

    def f(cols, anchor):
        first = anchor.shape[0] - 2
        return base[first:first + 3].sum() * 1000 + torch.arange(cols.shape[0]).float().sum()

    def marked(*tensors):
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)
        return tensors

    example = marked(torch.ones(16), torch.empty(16, 0))
    fn = torch.compile(f, backend="inductor", dynamic=False, fullgraph=True).aot_compile(
        (example, {})).fn
    for n, m in ((16, 16), (32, 16), (16, 40), (48, 48)):
        cols, anchor = marked(torch.ones(n), torch.empty(m, 0))
        assert fn(cols, anchor).item() == f(cols, anchor).item()


def test_traced_text_equal_with_and_without_the_in_place_read(random_whisper, engines, audios):
    """Two clips together, then one, read through the gathering graphs and through the in-place
    ones: all equal the eager text (both variants of keys (2, 1) and (1, 1) side by side). A
    fresh pool, so the first two clips' regions are each one run of slots."""
    eager = engines[1]
    traced = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                          cpu_compile="off")
    runner = traced.runner.graph_runner = CompiledDecodeRunner(
        traced.model, traced.pools, 2, traced.model.max_encoder_len, traced.max_decoder_len, 0,
        None, backend="eager")
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=1, max_new_tokens=24)
    for view in (True, False, True):
        runner.cross_view = view
        for clips in (audios[:2], audios[:1]):
            got = [r.text for r in transcribe(traced, clips, options=opts)]
            assert got == [r.text for r in transcribe(eager, clips, options=opts)]
    assert {(2, 1, False), (2, 1, True), (1, 1, False), (1, 1, True)} <= runner.variants


def test_two_runners_in_one_process_keep_their_own_graphs(random_whisper, engines, audios):
    """Each runner (another engine, another pool) keeps its own graphs, called without guards:
    the same keys in turn in two runners, text equal to eager each time (when dynamo's cache
    was shared by code object, the step benchmark's runner met "Recompilation triggered" after
    this file's runners had compiled)."""
    eager = engines[1]
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=1, max_new_tokens=16)
    want = transcribe(eager, audios[:1], options=opts)[0].text
    engines_ = []
    for _ in range(2):
        e = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                         cpu_compile="off")
        e.runner.graph_runner = CompiledDecodeRunner(
            e.model, e.pools, 2, e.model.max_encoder_len, e.max_decoder_len, 0, None,
            backend="eager")
        engines_.append(e)
    for view in (True, False, True, False):  # both variants of key (1, 1) in each runner
        for e in engines_:
            e.runner.graph_runner.cross_view = view
            assert transcribe(e, audios[:1], options=opts)[0].text == want
    for runner in (e.runner.graph_runner for e in engines_):
        assert runner.steps > 0 and runner.variants == {(1, 1, False), (1, 1, True)}


@pytest.fixture(scope="module")
def int8_engines(random_whisper, engines):
    kw = dict(model=str(random_whisper), device="cpu", max_running_requests=1,
              quantization="int8", dtype="float32")
    return build_engine(cpu_compile="on", **kw), build_engine(cpu_compile="off", **kw)


def test_compiled_int8_text_equals_eager_through_the_native_op(int8_engines, audios):
    """int8 greedy through inductor's C++ code, every int8 linear a call of the native op
    (edserve_int8::linear, built at the first compile): the eager int8 text."""
    from edserve.models.quantize import Int8Linear

    compiled, eager = int8_engines
    _same_text(compiled, eager, audios, beam_size=1)
    int8 = [m for m in compiled.model.modules() if isinstance(m, Int8Linear)]
    assert compiled.runner.graph_runner.native_linears == len(int8) > 0
    assert all(m.native is not None for m in int8)


def test_traced_int8_text_equals_eager_through_the_opaque_op(int8_engines, audios,
                                                              monkeypatch):
    """Without the native op (``native_int8=False``; a machine where it does not build) the
    traced graph calls the opaque op: the same text."""
    from edserve.models import opaque_linear

    compiled, eager = int8_engines
    calls = [0]

    def counted(fn):
        def call(x):
            calls[0] += 1
            return fn(x)
        return call

    for m in compiled.model.modules():  # what the opaque op calls, counted
        if hasattr(m, "attach_native"):
            monkeypatch.setitem(opaque_linear._DIRECT, m.handle,
                                counted(opaque_linear._DIRECT[m.handle]))
    saved = compiled.runner.graph_runner
    runner = compiled.runner.graph_runner = CompiledDecodeRunner(
        compiled.model, compiled.pools, 1, compiled.model.max_encoder_len,
        compiled.max_decoder_len, 0, None, backend="eager", native_int8=False)
    hidden = {m: m.__dict__.pop("native", None) for m in compiled.model.modules()
              if hasattr(m, "attach_native")}  # as if never attached
    try:
        before = calls[0]
        _same_text(compiled, eager, audios, beam_size=1)
        assert runner.native_linears == 0
        assert calls[0] - before >= runner.steps * 2  # the graph's linears went through it
    finally:
        compiled.runner.graph_runner = saved
        for m, handle in hidden.items():
            if handle is not None:
                m.native = handle
