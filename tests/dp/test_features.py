"""edserve.dp.features.FeatureService: several jobs at once (one thread, stream and socket
each), every answer the log-mel of its own call, errors answered without stopping the others,
and close() stopping every thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from edserve.audio.device_mel import device_features
from edserve.audio.prepare import DecodedAudio
from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.dp.features import CUDA_THREADS, FeatureService


@pytest.fixture
def pull():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    endpoint = f"inproc://features-{id(sock)}"
    sock.bind(endpoint)
    yield ctx, sock, endpoint
    sock.close(0)
    ctx.term()


def test_jobs_run_side_by_side_and_each_answer_is_its_own(pull):
    ctx, sock, endpoint = pull
    service = FeatureService(3, ctx, endpoint, torch.device("cpu"), 80, threads=3)
    assert len(service._threads) == 3
    rng = np.random.default_rng(0)
    audios = {i: DecodedAudio((0.1 * rng.standard_normal(16000 * (1 + i))).astype(np.float32))
              for i in range(5)}
    for i, audio in audios.items():
        service.submit(i, audio)
    service.submit(99, "not audio")
    replies = {}
    for _ in range(len(audios) + 1):
        assert sock.poll(60_000), "a feature job did not answer"
        reply = wire.recv(sock)
        assert isinstance(reply, P.Reply) and reply.worker == 3
        replies[reply.call_id] = reply
    assert not replies[99].ok and replies[99].error_type == "TypeError"
    for i, audio in audios.items():
        assert replies[i].ok, replies[i].value
        want = device_features(audio, 80, "cpu")
        assert replies[i].value.num_samples == audio.num_samples
        np.testing.assert_array_equal(replies[i].value.mel.full(), want.mel.full())
    service.close()
    assert not any(t.is_alive() for t in service._threads)


def test_thread_count_per_device(pull):
    ctx, _, endpoint = pull
    cpu = FeatureService(0, ctx, endpoint, torch.device("cpu"), 80)
    try:
        assert len(cpu._threads) == 1  # beside the CPU engine's own threads
    finally:
        cpu.close()
    with pytest.raises(ValueError, match=">= 1 thread"):
        FeatureService(0, ctx, endpoint, torch.device("cpu"), 80, threads=0)
    assert CUDA_THREADS > 1
