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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_with_a_store_the_log_mel_stays_and_its_windows_equal_the_values(pull, device):
    """The answer holds an id (HeldMel), not the values; windows written out by the store
    equal the same windows of the values answer's log-mel (bit for bit on the CPU); a store
    that is full answers values (the path without one)."""
    from edserve.audio.held_mel import HeldMel
    from edserve.audio.mel import window_features
    from edserve.dp.mel_store import MelStore

    ctx, sock, endpoint = pull
    store = MelStore()
    audio = DecodedAudio((0.1 * np.random.default_rng(1).standard_normal(16000 * 70))
                         .astype(np.float32))
    held_service = FeatureService(0, ctx, endpoint, torch.device(device), 80, store=store)
    plain_service = FeatureService(0, ctx, endpoint, torch.device(device), 80,
                                   store=MelStore(max_bytes=0))
    try:
        held_service.submit(1, audio)
        plain_service.submit(2, audio)
        replies = {}
        for _ in range(2):
            assert sock.poll(60_000)
            reply = wire.recv(sock)
            replies[reply.call_id] = reply
    finally:
        held_service.close()
        plain_service.close()
    held, values = replies[1].value, replies[2].value
    assert isinstance(held.mel, HeldMel) and len(store) == 1
    assert held.mel.shape == values.mel.shape and held.num_samples == audio.num_samples
    full = values.mel.full()
    for seek, size in [(0, 3000), (3000, 3000), (6500, 500)]:
        for padding in ("silence", "zeros"):
            got = store.window(window_features(held.mel, seek, size, padding))
            assert got.device.type == device
            want = window_features(full, seek, size, padding)
            # one device computes both (cuFFT may pick another plan per call on CUDA)
            torch.testing.assert_close(got.cpu(), want, rtol=0,
                                       atol=0 if device == "cpu" else 1e-5)
    assert store.release(held.mel.mel_id) and store.held_bytes == 0
