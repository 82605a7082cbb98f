"""AsyncEngine: concurrent submits share the engine, streams match generate, cancellation
aborts (KV freed), KV exhaustion queues instead of failing."""

from __future__ import annotations

import asyncio

import pytest
import torch
from whisper_fixtures import make_random_whisper

from edserve.engine.async_engine import AsyncEngine
from edserve.engine.engine import Engine
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("async_whisper"))


def _requests(n: int, new_tokens: int = 12, seed: int = 0) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                            SamplingParams(max_new_tokens=new_tokens + i % 3, ignore_eos=True))
            for i in range(n)]


def _run(aengine: AsyncEngine, coro):
    try:
        return asyncio.run(coro)
    finally:
        aengine.shutdown()


def _idle_check(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.pools.allocator.available_size() == engine.pools.allocator.size
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_concurrent_generate_matches_sync(model_dir):
    reference = build_engine(model=str(model_dir)).generate(_requests(6))
    engine = build_engine(model=str(model_dir), max_running_requests=4)
    aengine = AsyncEngine(engine).start()

    async def main():
        return await asyncio.gather(*(aengine.generate(r) for r in _requests(6)))

    outs = _run(aengine, main())
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    _idle_check(engine)


def test_stream_deltas_match_output(model_dir):
    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()

    async def main():
        tokens, last = [], None
        async for delta in aengine.stream(_requests(1, 9)[0]):
            tokens += delta.token_ids
            last = delta
        return tokens, last

    tokens, last = _run(aengine, main())
    assert last.finished and last.output.token_ids == tokens and len(tokens) == 9
    _idle_check(engine)


def test_cancel_aborts_and_frees_kv(model_dir):
    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()
    aborted = []
    original = engine.abort
    engine.abort = lambda rid: (aborted.append(rid), original(rid))

    async def main():
        req = _requests(1, 400)[0]
        stream = aengine.stream(req)
        async for delta in stream:
            if delta.token_ids:
                break  # the consumer goes away mid-stream
        await stream.aclose()
        long = asyncio.ensure_future(aengine.generate(_requests(1, 400, seed=1)[0]))
        await asyncio.sleep(0.3)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        for _ in range(400):  # bounded wait for the engine thread to process the aborts
            if aengine.num_inflight == 0 and not engine.has_work():
                break
            await asyncio.sleep(0.05)
        await aengine.call(engine.check_integrity)
        return req.rid

    rid = _run(aengine, main())
    assert rid in aborted and len(aborted) == 2
    _idle_check(engine)


def test_kv_exhaustion_queues(model_dir):
    probe = build_engine(model=str(model_dir), page_size="1")
    need = probe.make_req(_requests(1, 20)[0]).reserved_slots
    engine = build_engine(model=str(model_dir), page_size="1", max_total_tokens=2 * need + 10)
    aengine = AsyncEngine(engine).start()

    async def main():
        return await asyncio.gather(*(aengine.generate(r) for r in _requests(7, 18)))

    outs = _run(aengine, main())
    assert all(o.finish_reason == FinishReason.LENGTH and o.error is None for o in outs)
    _idle_check(engine)


def test_invalid_request_raises_and_call_runs_on_engine_thread(model_dir):
    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()

    async def main():
        with pytest.raises(ValueError):
            await aengine.generate(GenerateRequest([], torch.zeros(80, 3000)))
        import threading

        name = await aengine.call(lambda: threading.current_thread().name)
        assert name == "edserve-engine"
        assert aengine.is_alive and aengine.num_inflight == 0

    _run(aengine, main())
    assert not aengine.is_alive


def test_engine_calls_never_starve_steps(model_dir):
    """Many queued engine-thread calls (e.g. clients polling /debug/integrity) run one per
    step while there is work: decoding keeps its pace."""
    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()
    steps = [0]
    original = engine.step

    def counting_step() -> None:
        steps[0] += 1
        original()

    engine.step = counting_step

    async def main():
        job = asyncio.ensure_future(aengine.generate(_requests(1, 60)[0]))
        while steps[0] == 0:
            await asyncio.sleep(0.01)
        seen = await asyncio.gather(*(aengine.call(lambda: steps[0]) for _ in range(30)))
        await job
        return seen

    seen = _run(aengine, main())
    busy = [s for s in seen if s < 60]  # calls that ran while the request was decoding
    assert len(busy) >= 2 and len(set(busy)) == len(busy), seen  # one call per step


def test_engine_client_stats_validate_and_request_failed(model_dir):
    from edserve.engine.local_client import InProcessClient
    from edserve.engine.protocol import RequestFailed

    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()
    client = InProcessClient(aengine, "tiny")
    total = engine.pools.allocator.size
    assert client.stats().kv_total == total and client.stats().kv_used == 0
    assert client.max_decoder_len == engine.max_decoder_len and client.n_mels == 80
    assert not client.is_mllama and client.model_name == "tiny"
    with pytest.raises(ValueError):
        client.validate(GenerateRequest([], torch.zeros(80, 3000)))
    client.validate(_requests(1)[0])
    seen_running = []
    aengine.add_step_hook(lambda: seen_running.append(client.stats().running))

    async def main():
        out = await client.generate(_requests(1, 10)[0])
        assert len(out.token_ids) == 10
        report = await client.integrity()
        assert report["ok"] and report["kv_slots_used"] == 0
        req = _requests(1, 400, seed=3)[0]
        job = asyncio.ensure_future(client.generate(req))
        while client.stats().running == 0:
            await asyncio.sleep(0.01)
        client.abort(req.rid)
        with pytest.raises(RequestFailed):
            await job

    _run(aengine, main())
    assert max(seen_running) == 1
    assert client.stats().generated_tokens >= 10 and client.stats().kv_used == 0
    _idle_check(engine)


def test_stats_refresh_after_a_call_that_frees_kv(model_dir):
    """Releasing a held encoder runs as a call on an idle engine (no step follows): the
    stats snapshot (the /metrics KV gauges) must still show the freed slots."""
    from edserve.engine.local_client import InProcessClient

    engine = build_engine(model=str(model_dir))
    aengine = AsyncEngine(engine).start()
    client = InProcessClient(aengine, "tiny")

    async def main():
        req = _requests(1, 3)[0]
        req.keep_encoder = True
        out = await client.generate(req)
        assert out.encoder_kv is not None
        await asyncio.sleep(0.05)
        assert client.stats().kv_used > 0  # the held encoder region
        client.release_encoder(out.encoder_kv)
        for _ in range(200):
            if client.stats().kv_used == 0:
                break
            await asyncio.sleep(0.01)
        assert client.stats().kv_used == 0

    _run(aengine, main())
    _idle_check(engine)
