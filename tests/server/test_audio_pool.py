"""The audio preparers: worker processes give the same features and refusals as threads;
a worker that dies fails only the job it held (``AudioWorkerLost``) and is replaced; a job
still queued is dropped when its caller is cancelled."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from edserve.audio.compact_mel import CompactMel
from edserve.audio.errors import AudioDecodeError, AudioTooLongError, EmptyAudioError
from edserve.audio.prepare import prepare_upload
from edserve.server.audio_dispatch import DEPTH
from edserve.server.audio_pool import (
    AudioWorkerLost,
    ProcessPreparer,
    ThreadPreparer,
    auto_workers,
    make_preparer,
)

JFK = (Path(__file__).resolve().parents[1] / "data" / "jfk.wav").read_bytes()
DIE = b"die"


def dying_job(data: bytes, n_mels: int, max_seconds, cancel=None):
    """``prepare_upload``, except that the bytes ``b"die"`` kill the worker process (as a
    crashing decoder would) and ``b"slow..."`` sleep first."""
    if data == DIE:
        os._exit(3)
    if data.startswith(b"slow"):
        time.sleep(float(data[4:]))
        return prepare_upload(JFK, n_mels, max_seconds)
    return prepare_upload(data, n_mels, max_seconds, cancel)


@pytest.fixture(scope="module")
def pool():
    p = ProcessPreparer(80, 2, job=dying_job)
    p.start()
    assert len(p.pids()) == 2
    yield p
    p.shutdown()


def _run(coro):
    return asyncio.run(coro)


def test_process_and_thread_give_the_same_features(pool):
    cancel = threading.Event()
    a = _run(pool.prepare(JFK, 60.0, cancel))
    b = _run(ThreadPreparer(80).prepare(JFK, 60.0, cancel))
    assert a.num_samples == b.num_samples == 176000
    assert isinstance(a.mel, CompactMel)  # across the process boundary without its tail
    assert torch.equal(a.mel.full(), b.mel.full())


@pytest.mark.parametrize("data,limit,exc", [(b"RIFF" + bytes(300), None, AudioDecodeError),
                                            (JFK, 2.0, AudioTooLongError)])
def test_refusals_cross_the_process_boundary(pool, data, limit, exc):
    with pytest.raises(exc):
        _run(pool.prepare(data, limit, threading.Event()))


def test_dead_worker_fails_its_job_and_is_replaced(pool):
    async def burst():
        return await asyncio.gather(pool.prepare(b"slow0.5", None, threading.Event()),
                                    pool.prepare(DIE, None, threading.Event()),
                                    return_exceptions=True)

    before = pool.restarts
    slow, dead = _run(burst())
    assert isinstance(dead, AudioWorkerLost), dead
    assert slow.num_samples == 176000  # the other worker's job is not lost with it
    assert pool.restarts == before + 1
    again = _run(pool.prepare(JFK, 60.0, threading.Event()))  # a fresh pool serves
    assert again.num_samples == 176000


def test_jobs_travel_without_helper_threads(pool):
    """The event loop sends jobs and reads answers itself (no executor manager or queue
    feeder threads in the API process)."""
    before = threading.active_count()

    async def many():
        return await asyncio.gather(*(pool.prepare(JFK, 60.0, threading.Event())
                                      for _ in range(6)))

    assert all(r.num_samples == 176000 for r in _run(many()))
    assert threading.active_count() == before


def exit_at_start(endpoint: str, identity: bytes) -> None:
    """A worker main that dies before its first message (as a broken install would)."""
    os._exit(5)


def test_workers_that_cannot_start_fail_the_job_then_a_new_pool_serves(monkeypatch):
    import edserve.server.audio_dispatch as dispatch

    serve = dispatch.serve
    monkeypatch.setattr(dispatch, "serve", exit_at_start)
    p = ProcessPreparer(80, 1)
    try:
        with pytest.raises(AudioWorkerLost):
            _run(asyncio.wait_for(p.prepare(JFK, 60.0, threading.Event()), 60))
        assert p._workers.broken and p.pids() == []
        assert p._workers.restarts == dispatch.MAX_FAILED_STARTS
        monkeypatch.setattr(dispatch, "serve", serve)
        again = _run(p.prepare(JFK, 60.0, threading.Event()))
        assert again.num_samples == 176000 and not p._workers.broken
    finally:
        p.shutdown()


def test_cancelled_caller_drops_its_queued_job(pool):
    async def scenario():
        busy = [asyncio.ensure_future(pool.prepare(b"slow0.6", None, threading.Event()))
                for _ in range(2 * DEPTH)]  # both workers running one, one queued behind
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(pool.prepare(JFK, 60.0, threading.Event()))
        await asyncio.sleep(0.05)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        return await asyncio.gather(*busy)

    assert all(r.num_samples == 176000 for r in _run(scenario()))


def test_uploads_go_through_shared_slots_and_come_back(pool):
    """A job's upload takes a shared-memory slot while it runs and frees it when done (also
    after a worker died or a caller left, the tests above); an upload larger than a slot
    goes by pipe and gives the same features as the threads."""
    from edserve.server.upload_slots import SLOT_BYTES, SLOTS
    from tests.server.server_helpers import wav_bytes

    assert pool._slots is not None
    deadline = time.monotonic() + 5  # a job of an earlier test may still be finishing
    while pool._slots.num_free < SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._slots.num_free == SLOTS

    async def one_slow():
        job = asyncio.ensure_future(pool.prepare(b"slow0.3", None, threading.Event()))
        await asyncio.sleep(0.1)
        taken = pool._slots.num_free
        await job
        return taken

    assert _run(one_slow()) == SLOTS - 1 and pool._slots.num_free == SLOTS
    big = wav_bytes(_long_audio())
    assert len(big) > SLOT_BYTES
    a = _run(pool.prepare(big, None, threading.Event()))
    b = _run(ThreadPreparer(80).prepare(big, None, threading.Event()))
    assert a.num_samples == b.num_samples and torch.equal(a.mel.full(), b.mel.full())
    assert pool._slots.num_free == SLOTS


def _long_audio():
    """40 s of audio (the test clip repeated): a WAV larger than one slot."""
    import numpy as np

    from edserve.audio.decode import load_audio

    clip = load_audio(JFK)
    return np.concatenate([clip] * 4)


def test_worker_count_and_strategy():
    assert auto_workers(16) == 8 and auto_workers(2) == 1 and auto_workers(64) == 8
    assert isinstance(make_preparer(0, 80), ThreadPreparer)
    p = make_preparer(3, 128)
    assert isinstance(p, ProcessPreparer) and p.workers == 3 and p.pids() == []
    with pytest.raises(ValueError):
        make_preparer(-1, 80)


def test_thread_preparer_empty_upload():
    with pytest.raises(EmptyAudioError):
        _run(ThreadPreparer(80).prepare(b"", None, threading.Event()))
