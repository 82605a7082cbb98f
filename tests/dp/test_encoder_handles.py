"""Encoder reuse under engine worker processes (two tiny.en workers on CPU): a ``keep_encoder``
handle is an id valid on the worker that made it, a retry that passes it runs there without
encoding again (its encoder input not sent), a handle whose worker restarted re-encodes (also
for the long-form driver's fallback), and every handle is released (no held region, no used
KV slot after each test)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal

import pytest

from dp.reference import DATA, wait_for
from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.dp.errors import WorkerLost
from edserve.dp.router import pick
from edserve.engine.async_engine import AsyncEngine
from edserve.engine.local_client import InProcessClient
from edserve.engine.request import GenerateRequest
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, transcribe_async
from edserve.whisper.usage import TokenUsage

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


def sent_requests(client, monkeypatch) -> list[tuple[GenerateRequest, int]]:
    """Spy on the supervisor: every request as it went on the wire, with its bytes."""
    sent = []
    submit = client.supervisor.submit

    def spy(rid, frames, worker=None):
        msg = pickle.loads(frames[0], buffers=frames[1:])
        sent.append((msg.request, sum(memoryview(f).nbytes for f in frames)))
        return submit(rid, frames, worker)

    monkeypatch.setattr(client.supervisor, "submit", spy)
    return sent


def run_fallback(engine, audio, on_output=None):
    """jfk's one window at the three temperatures through ``transcribe_async``: the result,
    the (request, output) pairs and the token usage."""
    task, outputs, usage = make_task(engine, audio, FORCED, "jfk"), [], TokenUsage()
    assert task.reuse_encoder

    def seen(req, out):
        outputs.append((req, out))
        usage.add(req, out)
        if on_output is not None:
            on_output(req, out)

    async def run():
        async for _ in transcribe_async(engine, task, seen):
            pass

    asyncio.run(run())
    return task.result(), outputs, usage


@pytest.fixture(scope="module")
def in_process(jfk):
    """The fallback on an in-process engine: result, outputs, usage, encoder runs."""
    aengine = AsyncEngine(engine := build_engine()).start()
    try:
        before = engine.runner.num_encoded_inputs
        expected, outputs, usage = run_fallback(InProcessClient(aengine), jfk)
        encoded = engine.runner.num_encoded_inputs - before
    finally:
        aengine.shutdown()
    assert expected.segments[0].temperature == 0.4  # the fallback ran to the end
    assert len(outputs) == 3 and encoded == 1  # one window, three temperatures, one encode
    return expected, usage


def test_fallback_retries_go_without_their_window(client, jfk, in_process, monkeypatch):
    """The retries reuse the first attempt's handle: the client sends them without the
    window's log-mel (the caller's requests keep it), the worker does not encode again, and
    the tokens and the usage are the in-process engine's."""
    expected, expected_usage = in_process
    sent = sent_requests(client, monkeypatch)
    before = encoder_counts(client)
    got, outputs, usage = run_fallback(client, jfk)
    after = encoder_counts(client)
    handle = outputs[0][1].encoder_kv
    assert len(outputs) == 3 and handle is not None
    assert all(q.encoder_kv is handle and q.encoder_input is not None for q, _ in outputs[1:])
    (first, first_bytes), *retries = sent
    # the 11 s clip's compact log-mel: [80, 1152] float32 (369 kB), then its fill value
    assert first.encoder_input is not None and first.keep_encoder and first_bytes > 300_000
    assert len(retries) == 2
    for request, size in retries:
        assert request.encoder_input is None and request.encoder_kv is not None
        assert size < 5_000, size  # prompt, filters, sampling (~1 kB)
    assert sum(c["encoded"] for c in after) == sum(c["encoded"] for c in before) + 1
    assert got.text == expected.text
    assert [s.tokens for s in got.segments] == [s.tokens for s in expected.segments]
    assert usage == expected_usage and usage.audio_tokens == 3 * 1500
    assert_clean(client)


def test_fallback_re_encodes_when_the_handles_worker_restarted(client, jfk, in_process,
                                                               monkeypatch):
    """The handle's worker dies after the first attempt: the retries go with their window
    and re-encode it (no 503), and the transcript and usage do not change."""
    expected, expected_usage = in_process
    sent = sent_requests(client, monkeypatch)
    restarted = {}

    def kill_the_owner(req, out):
        if out.encoder_kv is None:
            return
        owner = client.workers[client.supervisor.handles.get(out.encoder_kv).worker]
        generation = owner.generation
        os.kill(owner.pid, signal.SIGKILL)
        wait_for(lambda: owner.generation > generation and owner.ready, 120, "the restart")
        restarted["encoded"] = sum(c["encoded"] for c in encoder_counts(client))

    got, outputs, usage = run_fallback(client, jfk, kill_the_owner)
    assert len(outputs) == 3 and restarted
    assert [(r.encoder_input is None, r.encoder_kv is None) for r, _ in sent[1:]] == \
        [(False, True)] * 2  # sent with the window, without the dead handle
    assert sum(c["encoded"] for c in encoder_counts(client)) == restarted["encoded"] + 2
    assert got.text == expected.text
    assert [s.tokens for s in got.segments] == [s.tokens for s in expected.segments]
    assert usage == expected_usage
    assert_clean(client)
