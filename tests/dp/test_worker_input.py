"""The worker's input thread (edserve.dp.worker_input): requests are admitted there, off the
stepping thread; what touches the scheduler's state still runs between steps on the stepping
thread; a message that cannot be decoded stops the worker instead of leaving it deaf."""

from __future__ import annotations

import threading

import pytest
from whisper_fixtures import make_random_whisper

from edserve.dp import protocol as P
from edserve.dp.worker_input import INPUT_THREAD
from edserve.runtime import build_engine
from tests.dp.test_worker_loop import Harness, _request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("input_whisper"))


def _record_threads(obj, name: str, seen: list[str]) -> None:
    original = getattr(obj, name)

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)
    setattr(obj, name, spy)


def test_requests_are_admitted_on_the_input_thread_and_releases_between_steps(model_dir):
    engine = build_engine(model=str(model_dir))
    admitted, released, stepped = [], [], []
    _record_threads(engine, "make_req", admitted)
    _record_threads(engine.scheduler, "release_encoder", released)
    _record_threads(engine, "step", stepped)
    h = Harness(engine, "input-thread")
    try:
        out = h.keep(4)
        h.send(P.ReleaseEncoder(out.encoder_kv.id))
        # a dry-run admission (input thread too), then the integrity check (between steps)
        replies = h.call_replies(("validate", _request(4)), ("integrity",))
        assert replies[1].ok and replies[2].ok and replies[2].value["kv_slots_used"] == 0
    finally:
        h.close()
    loop_thread = h.thread.name
    assert admitted == [INPUT_THREAD, INPUT_THREAD]
    assert set(stepped) == {loop_thread} and released == [loop_thread]
    assert not h.loop.input.is_alive()  # stopped with the loop
    engine.check_integrity()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_undecodable_message_stops_the_worker(model_dir):
    engine = build_engine(model=str(model_dir))
    h = Harness(engine, "input-garbage")
    failed = []
    try:
        h.down_push.send(b"not a pickle")
        h.thread.join(10)  # the loop raises what failed the input thread
        failed.append(h.thread.is_alive())
        assert h.loop.input.error is not None
    finally:
        for s in h.sockets:
            s.close(0)
        h.ctx.term()
    assert failed == [False]
