"""The wire format between the API process and its workers: host tensors travel as numpy
arrays out of band, arrive equal, contiguous and writable; other tensors pickle as usual."""

from __future__ import annotations

import pickle

import pytest
import torch
import zmq

from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.engine.request import GenerateRequest


@pytest.fixture
def pair(tmp_path):
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    url = f"ipc://{tmp_path}/wire"
    push.bind(url)
    pull.connect(url)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_a_log_mel_view_arrives_equal_contiguous_writable(pair):
    push, pull = pair
    whole = torch.randn(128, 4100)
    view = whole[:, 100:3100]  # a window of a whole-audio log-mel
    msg = P.Generate(GenerateRequest(prompt_ids=[1, 2], encoder_input=view), stream=True)
    wire.send(push, msg)
    got = wire.recv(pull)
    x = got.request.encoder_input
    assert type(got) is P.Generate and got.stream and got.request.prompt_ids == [1, 2]
    assert torch.equal(x, view) and x.is_contiguous() and x.dtype == torch.float32
    x.add_(1.0)  # writable (the frame's memory), and not the sender's
    assert torch.equal(view, whole[:, 100:3100]) and not torch.equal(x, view)
    # only the window's elements travel, not its base's storage
    assert len(wire.dumps(msg)) < view.numel() * 4 + 4096


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5, dtype=torch.bfloat16),  # no numpy dtype: pickled as usual
    lambda: torch.arange(6, dtype=torch.int64).view(2, 3).t(),
    lambda: torch.tensor([True, False]),
    lambda: torch.randn(4, requires_grad=True),
])
def test_other_tensors_round_trip(pair, make):
    push, pull = pair
    t = make()
    wire.send(push, {"t": t, "n": 3})
    got = wire.recv(pull)["t"]
    assert got.dtype == t.dtype and got.requires_grad == t.requires_grad
    assert torch.equal(got.detach(), t.detach())


def test_nothing_waiting_raises_again(pair):
    _, pull = pair
    with pytest.raises(zmq.Again):
        wire.recv(pull, zmq.NOBLOCK)


def test_dumps_is_plain_pickle():
    t = torch.randn(2, 3)
    assert torch.equal(pickle.loads(wire.dumps(t)), t)
