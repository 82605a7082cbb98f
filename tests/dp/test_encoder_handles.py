"""Encoder reuse under engine worker processes (two tiny.en workers on CPU): a ``keep_encoder``
handle is an id valid on the worker that made it, a retry that passes it runs there without
encoding again, a handle whose worker restarted re-encodes, and every handle is released
(no held region, no used KV slot after each test)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from dp.reference import DATA, wait_for
from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.dp.errors import WorkerLost
from edserve.dp.router import pick
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, run_tasks, transcribe_async

# logprob_threshold 0: every window's average log-probability is below it, so each window is
# decoded at all three temperatures (the last one is accepted).
FORCED = TranscribeOptions(temperatures=(0.0, 0.2, 0.4), logprob_threshold=0.0, seed=3)


@pytest.fixture(scope="module")
def client():
    c = DataParallelClient(EngineConfig(), 2).start()
    yield c
    c.shutdown(5.0)


@pytest.fixture(scope="module")
def jfk():
    return load_audio(DATA / "jfk.wav")


def encoder_counts(client) -> list[dict]:
    """Per worker: ``held`` handles and ``encoded`` encoder inputs."""
    return [client.supervisor.call(w, "encoder").result(60) for w in client.workers]


def worker_reports(client) -> list[dict]:
    return [client.supervisor.call(w, "integrity").result(60) for w in client.workers]


def assert_clean(client) -> None:
    """No handle held anywhere, every KV slot free, every worker's KV consistent."""
    report = asyncio.run(client.integrity())
    assert report["ok"] and report["kv_slots_used"] == 0, report
    assert [c["held"] for c in encoder_counts(client)] == [0, 0]
    assert len(client.supervisor.handles) == 0


def first_window(client, audio):
    """The first window's request at temperature 0 (it asks for ``keep_encoder``)."""
    req = make_task(client, audio, FORCED, "jfk").next_request()
    assert req.keep_encoder and req.encoder_kv is None
    return req


def retry_of(req, handle):
    return dataclasses.replace(req, rid=req.rid + "-retry", keep_encoder=False,
                               encoder_kv=handle)


def test_retry_runs_on_the_handles_worker_without_encoding(client, jfk):
    req = first_window(client, jfk)
    before = encoder_counts(client)
    first = asyncio.run(client.generate(req))
    handle = first.encoder_kv
    assert handle is not None and handle.slots.numel() == 0  # an id, no slots
    owner = client.supervisor.handles.get(handle).worker
    after_first = encoder_counts(client)
    assert after_first[owner]["held"] == 1
    assert after_first[owner]["encoded"] == before[owner]["encoded"] + 1
    routed = [w.routed for w in client.workers]
    # the least-loaded pick would now be the other worker (more free KV: no held region)
    wait_for(lambda: pick(client.workers).index != owner, 30, "the owner's stats")
    retry = asyncio.run(client.generate(retry_of(req, handle)))
    assert retry.token_ids == first.token_ids  # temperature 0: same tokens over reused K/V
    bare = dataclasses.replace(retry_of(req, handle), rid=req.rid + "-bare", encoder_input=None)
    assert asyncio.run(client.generate(bare)).token_ids == first.token_ids  # no log-mel sent
    after_retry = encoder_counts(client)
    assert [c["encoded"] for c in after_retry] == [c["encoded"] for c in after_first]
    assert [w.routed - r for w, r in zip(client.workers, routed, strict=True)] == \
        [2 * int(i == owner) for i in range(2)]  # both routed to the owner
    fresh = asyncio.run(client.generate(dataclasses.replace(req, rid=req.rid + "-fresh",
                                                            keep_encoder=False)))
    assert fresh.token_ids == first.token_ids
    client.release_encoder(handle)
    wait_for(lambda: encoder_counts(client)[owner]["held"] == 0, 30, "the release")
    assert_clean(client)
    with pytest.raises(ValueError, match="not held"):  # released: no longer valid
        asyncio.run(client.generate(retry_of(req, handle)))
    client.release_encoder(handle)  # twice: only logged


def test_handle_of_a_restarted_worker_re_encodes(client, jfk):
    req = first_window(client, jfk)
    first = asyncio.run(client.generate(req))
    handle = first.encoder_kv
    owner = client.workers[client.supervisor.handles.get(handle).worker]
    generation = owner.generation
    os.kill(owner.pid, signal.SIGKILL)
    wait_for(lambda: owner.generation > generation and owner.ready, 120, "the restart")
    before = encoder_counts(client)
    bare = dataclasses.replace(retry_of(req, handle), encoder_input=None)
    with pytest.raises(WorkerLost, match="no encoder input"):  # nothing to encode again
        asyncio.run(client.generate(bare))
    retry = asyncio.run(client.generate(retry_of(req, handle)))
    assert retry.token_ids == first.token_ids
    after = encoder_counts(client)
    assert sum(c["encoded"] for c in after) == sum(c["encoded"] for c in before) + 1
    client.release_encoder(handle)  # its KV went with the process: nothing to send
    assert_clean(client)


def test_handle_nobody_takes_is_released(client, jfk):
    """The caller stops listening after its request finished with a handle it never saw
    (released by the client), or before it finished (released by the I/O thread)."""
    req, dropped = first_window(client, jfk), first_window(client, jfk)

    async def run() -> None:
        deltas = client.stream(req)
        await deltas.__anext__()  # the first token: running on a worker
        await asyncio.to_thread(wait_for, lambda: len(client.supervisor.handles) == 1, 60,
                                "the finished output's handle")
        await deltas.aclose()
        assert len(client.supervisor.handles) == 0
        deltas = client.stream(dropped)
        await deltas.__anext__()
        client.supervisor.forget(dropped.rid, abort=False)  # it runs on, nobody listens
        await deltas.aclose()

    asyncio.run(run())
    wait_for(lambda: all(r["running"] + r["waiting"] == 0 for r in worker_reports(client)),
             60, "the dropped request's end")
    assert len(client.supervisor.handles) == 0
    wait_for(lambda: sum(c["held"] for c in encoder_counts(client)) == 0, 30, "the releases")
    assert_clean(client)


def test_fallback_driver_reuses_the_encoder_like_in_process(client, jfk):
    engine = build_engine()
    task = make_task(engine, jfk, FORCED, "jfk")
    before = engine.runner.num_encoded_inputs
    run_tasks(engine, [task])
    assert engine.runner.num_encoded_inputs - before == 1  # one window, three temperatures
    expected = task.result()
    assert expected.segments[0].temperature == 0.4  # the fallback ran to the end

    async def run():
        dp_task = make_task(client, jfk, FORCED, "jfk")
        assert dp_task.reuse_encoder
        outputs = []
        async for _ in transcribe_async(client, dp_task, lambda q, o: outputs.append((q, o))):
            pass
        return dp_task.result(), outputs

    before_dp = encoder_counts(client)
    got, outputs = asyncio.run(run())
    after_dp = encoder_counts(client)
    assert len(outputs) == 3 and outputs[0][1].encoder_kv is not None
    assert all(q.encoder_kv is outputs[0][1].encoder_kv for q, _ in outputs[1:])
    assert sum(c["encoded"] for c in after_dp) == sum(c["encoded"] for c in before_dp) + 1
    assert got.text == expected.text
    assert [s.tokens for s in got.segments] == [s.tokens for s in expected.segments]
    assert_clean(client)
