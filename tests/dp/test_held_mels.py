"""edserve.dp.held_mels.HeldMels: a worker's held log-mel becomes the caller's (a client id,
released once: explicitly, when the task ends, or when it is collected), a window is routed to
the holding worker with that worker's id, and a restarted worker's log-mel fails the window
with a 503 rather than running it elsewhere."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from edserve.audio.held_mel import HeldMel
from edserve.audio.prepare import PreparedAudio
from edserve.dp.errors import WorkerLost
from edserve.dp.held_mels import HeldMels
from edserve.dp.wire import dumps


class Sent:
    def __init__(self, ok: bool = True) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.ok = ok

    def __call__(self, worker: int, generation: int, mel_id: int) -> bool:
        self.calls.append((worker, generation, mel_id))
        return self.ok


def _answer(mel_id: int) -> PreparedAudio:
    return PreparedAudio(HeldMel(mel_id, 80, 9000), 16000 * 60, 0.1, 0.02)


def test_adopt_route_and_release_once():
    sent = Sent()
    mels = HeldMels(sent)
    value = mels.adopt(2, 5, _answer(41))
    mel = value.mel
    assert isinstance(mel, HeldMel) and mel.shape == (80, 9000) and len(mels) == 1
    assert value.num_samples == 16000 * 60 and value.features_s == 0.02
    window = mel.window(100, 3100)
    routed, worker = mels.route(window, lambda slot: 5 if slot == 2 else 0)
    assert worker == 2 and routed.mel_id == 41 and (routed.start, routed.stop) == (100, 3100)
    mel.release()
    mel.release()
    assert sent.calls == [(2, 5, 41)] and len(mels) == 0
    with pytest.raises(ValueError, match="not held"):
        mels.route(window, lambda slot: 5)
    del value, mel
    gc.collect()
    assert sent.calls == [(2, 5, 41)]  # released already: not again when collected


def test_dropping_the_caller_releases_it():
    sent = Sent(ok=False)  # the worker is gone: only logged
    mels = HeldMels(sent)
    mels.adopt(0, 1, _answer(7))  # an answer nobody takes (its caller was cancelled)
    gc.collect()
    assert sent.calls == [(0, 1, 7)] and len(mels) == 0


def test_a_restarted_worker_fails_the_window():
    mels = HeldMels(Sent())
    mel = mels.adopt(1, 3, _answer(9)).mel
    with pytest.raises(WorkerLost, match="restarted") as info:
        mels.route(mel.window(0, 3000), lambda slot: 4)  # generation 3 -> 4
    assert info.value.status == 503
    with pytest.raises(WorkerLost):
        mels.route(mel.window(0, 3000), lambda slot: None)  # not serving


def test_other_answers_pass_through_and_refs_pickle_without_hooks():
    mels = HeldMels(Sent())
    plain = PreparedAudio(np.zeros((80, 10), np.float32), 1600)
    assert mels.adopt(0, 0, plain) is plain and mels.adopt(0, 0, "x") == "x"
    mel = mels.adopt(0, 0, _answer(3)).mel
    assert b"HeldMels" not in dumps(mel.window(0, 5)) and b"lambda" not in dumps(mel)


def test_the_client_routes_a_window_and_its_encoder_handle_to_the_holding_worker():
    """DataParallelClient._route (no worker processes started: the slots' state is set here):
    a window runs on the worker holding its log-mel, with that worker's id; a live encoder
    handle takes the request to its own worker without the window (nothing to encode); a
    handle whose worker restarted is dropped and the window re-encodes on the log-mel's
    worker; a restarted holder fails the window with 503."""
    import torch

    from edserve.config import EngineConfig
    from edserve.dp.client import DataParallelClient
    from edserve.engine.request import EncoderKV, GenerateRequest

    client = DataParallelClient(EngineConfig(), 2)
    try:
        for w in client.workers:
            w.ready = True
        sup = client.supervisor
        mel = sup.mels.adopt(1, 0, _answer(7)).mel
        view = EncoderKV(torch.empty(0, dtype=torch.long), 1500, 0, id=5)
        same, other = sup.handles.adopt(1, 0, view), sup.handles.adopt(0, 0, view)
        window = mel.window(0, 3000)

        routed, worker = client._route(GenerateRequest([1, 2], window))
        assert worker == 1 and routed.encoder_input.mel_id == 7 and routed.encoder_kv is None
        retry = GenerateRequest([1, 2], window, encoder_kv=same)
        routed, worker = client._route(retry)
        assert worker == 1 and routed.encoder_input is None and routed.encoder_kv.id == 5
        assert retry.encoder_input is window  # the caller's request keeps it
        routed, worker = client._route(GenerateRequest([1, 2], window, encoder_kv=other))
        assert worker == 0 and routed.encoder_input is None  # its KV is on worker 0
        routed, worker = client._route(GenerateRequest([1, 2], None, encoder_kv=other))
        assert worker == 0 and routed.encoder_kv.id == 5
        client.workers[0].generation = 1  # worker 0 restarted: its handle went with it
        routed, worker = client._route(GenerateRequest([1, 2], window, encoder_kv=other))
        assert worker == 1 and routed.encoder_kv is None and routed.encoder_input.mel_id == 7
        with pytest.raises(WorkerLost, match="no encoder input"):
            client._route(GenerateRequest([1, 2], None, encoder_kv=other))
        client.workers[1].generation = 1  # worker 1 restarted: the log-mel went with it
        with pytest.raises(WorkerLost):
            client._route(GenerateRequest([1, 2], window))
    finally:
        client.shutdown(0.0)


def test_the_server_flag_sets_each_workers_budget():
    from edserve.config import EngineConfig
    from edserve.dp.client import DataParallelClient
    from edserve.dp.mel_store import BUDGET_ENV
    from edserve.server.config import ServerConfig

    assert ServerConfig().held_log_mel_mb == 4096
    with pytest.raises(ValueError, match="held-log-mel-mb"):
        ServerConfig(held_log_mel_mb=-1)
    client = DataParallelClient(EngineConfig(), 2, held_mel_bytes=0)
    try:
        assert [w.placement.env[BUDGET_ENV] for w in client.workers] == ["0", "0"]
    finally:
        client.shutdown(0.0)
