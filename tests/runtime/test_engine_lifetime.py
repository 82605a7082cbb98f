"""A dropped engine is freed by reference counting alone: nothing the engine or the
transcription driver leaves behind may hold it (and its KV pool) in a reference cycle until the
cycle collector happens to run. On CUDA that pool is most of the GPU: a second engine built in
the same process would find the device full."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine

JFK = "tests/data/jfk.wav"


@pytest.fixture
def no_cycle_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _generate(engine) -> None:
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(0)
    mels = [(torch.randn(80, 3000, generator=gen) * 0.5).to(engine.device) for _ in range(3)]
    out = engine.generate([GenerateRequest([tok.sot], m, SamplingParams(
        max_new_tokens=4, ignore_eos=True, beam_size=2 if i == 0 else 1, seed=i,
        temperature=0.7 if i == 2 else 0.0)) for i, m in enumerate(mels)])
    assert [len(o.token_ids) for o in out] == [4, 4, 4]


def _refs(engine) -> list[weakref.ref]:
    return [weakref.ref(engine), weakref.ref(engine.pools.kv_pool), weakref.ref(engine.model)]


def _assert_freed(refs: list[weakref.ref]) -> None:
    """Called after the test dropped its last reference to the engine."""
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"{alive} outlived the last reference (a reference cycle holds them)"


@pytest.mark.parametrize("beam_size, word_timestamps", [(1, False), (5, False), (5, True)])
def test_engine_freed_after_transcribe(no_cycle_collector, beam_size, word_timestamps):
    from edserve.api import Whisper

    engine = build_engine(device="cpu", max_running_requests=8)
    model = Whisper(engine=engine)
    result = model.transcribe(JFK, beam_size=beam_size, word_timestamps=word_timestamps)
    assert "ask not what your country can do for you" in result.text
    assert (result.words is not None) == word_timestamps
    model.close()
    refs = _refs(engine)
    del model, result, engine
    _assert_freed(refs)


def test_engine_freed_after_generate(no_cycle_collector, random_whisper):
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=4)
    _generate(engine)
    refs = _refs(engine)
    del engine
    _assert_freed(refs)


def test_engine_freed_with_device_beams(no_cycle_collector, random_whisper):
    """Device beams (the CUDA default; here on the CPU, without their graphs): the beam step's
    graphs once kept the beams that own them, a cycle that held every CUDA engine's pools (the
    CUDA test below covers the graphs)."""
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=4,
                          beam_on_device=True, overlap_schedule="on")
    assert engine.scheduler.beams is not None
    _generate(engine)
    refs = _refs(engine)
    del engine
    _assert_freed(refs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_freed_with_graphs(no_cycle_collector, random_whisper):
    before = torch.cuda.memory_allocated()
    engine = build_engine(model=str(random_whisper), device="cuda", max_running_requests=4,
                          encoder_cuda_graph_max_bs=2)
    assert engine.scheduler.beams.graphs is not None  # beam steps as graphs
    _generate(engine)
    _generate(engine)  # the second run's beam shapes are captured
    refs = _refs(engine)
    del engine
    _assert_freed(refs)
    torch.cuda.synchronize()
    # the pool filled the GPU (~110 GB on an H200); what stays is the process's own caches
    # (~0.1 GB measured there)
    assert torch.cuda.memory_allocated() - before < 1 << 30, "the KV pool was not freed"
