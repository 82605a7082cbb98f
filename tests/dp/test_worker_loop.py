"""The data-parallel worker's loop in this process (real engine, real ZeroMQ ``inproc``
sockets, no subprocess): typed messages in and out, calls between steps, a failed step fails
only the in-flight requests, stop drains."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch
import zmq
from whisper_fixtures import make_random_whisper

from edserve.dp import protocol as P
from edserve.dp import wire
from edserve.dp.worker import WorkerLoop
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("worker_whisper"))


def _request(new_tokens: int, seed: int = 0) -> GenerateRequest:
    g = torch.Generator().manual_seed(seed)
    return GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                           SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


class Harness:
    """A WorkerLoop on its own thread; ``send`` goes down, ``recv`` comes up."""

    def __init__(self, engine, name: str) -> None:
        self.ctx = zmq.Context()
        self.up_pull, up_push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.down_push, down_pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.up_pull.bind(f"inproc://{name}-up")
        up_push.connect(f"inproc://{name}-up")
        self.down_push.bind(f"inproc://{name}-down")
        down_pull.connect(f"inproc://{name}-down")
        self.sockets = (self.up_pull, up_push, self.down_push, down_pull)
        self.loop = WorkerLoop(3, engine, up_push, down_pull, os.getppid())
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        wire.send(self.down_push, msg)

    def recv_until(self, done, timeout_ms: int = 60_000) -> list:
        got = []
        while not done(got):
            assert self.up_pull.poll(timeout_ms), f"no message; got {got}"
            got.append(wire.recv(self.up_pull))
        return got

    def keep(self, new_tokens: int):
        """A ``keep_encoder`` request run to its end: its output (``encoder_kv`` an id view)."""
        kept = _request(new_tokens)
        kept.keep_encoder = True
        self.send(P.Generate(kept, False))
        return self.recv_until(_finished(kept.rid))[-1].delta.output

    def call_replies(self, *calls: tuple) -> dict:
        """Send ``P.Call(i, *call)`` for calls numbered from 1; their replies by number."""
        for i, call in enumerate(calls, 1):
            self.send(P.Call(i, *call))
        got = self.recv_until(lambda g: sum(isinstance(m, P.Reply) for m in g) == len(calls))
        return {m.call_id: m for m in got if isinstance(m, P.Reply)}

    def close(self) -> None:
        self.send(P.Stop(5.0))
        self.thread.join(30)
        assert not self.thread.is_alive()
        for s in self.sockets:
            s.close(0)
        self.ctx.term()


def _finished(rid: str):
    return lambda got: any(isinstance(m, P.Delta) and m.rid == rid and m.delta.finished
                           for m in got)


def test_typed_messages_round_trip(model_dir):
    engine = build_engine(model=str(model_dir))
    expected = engine.generate([_request(9)])[0].token_ids
    h = Harness(engine, "round")
    try:
        req = _request(9)
        h.send(P.Generate(req, True))
        got = h.recv_until(_finished(req.rid))
        deltas = [m for m in got if isinstance(m, P.Delta)]
        assert all(m.worker == 3 for m in got)
        assert [t for m in deltas for t in m.delta.token_ids] == expected
        assert deltas[-1].delta.output.token_ids == expected
        assert len(deltas) == 9  # streamed: one delta per token

        quiet = _request(9)
        h.send(P.Generate(quiet, False))  # not streamed: only the final delta
        got = h.recv_until(_finished(quiet.rid))
        assert [m.delta.output.token_ids for m in got if isinstance(m, P.Delta)] == [expected]

        bad = GenerateRequest([50257] * 500, torch.zeros(80, 3000))  # past the decoder
        h.send(P.Generate(bad, False))
        h.send(P.Call(1, "integrity"))
        h.send(P.Call(2, "validate", bad))
        h.send(P.Call(3, "no_such_call"))
        got = h.recv_until(lambda g: sum(isinstance(m, P.Reply) for m in g) == 3)
        assert [m.rid for m in got if isinstance(m, P.Reject)] == [bad.rid]
        replies = {m.call_id: m for m in got if isinstance(m, P.Reply)}
        assert replies[1].ok and replies[1].value["ok"] and replies[1].value["kv_slots_used"] == 0
        assert not replies[2].ok and replies[2].error_type == "ValueError"
        assert not replies[3].ok and "no_such_call" in replies[3].value
    finally:
        h.close()
    engine.check_integrity()
    with pytest.raises(TypeError, match="unexpected message tuple"):
        P.dispatch({}, ("gen", 0))


def test_failed_step_fails_in_flight_requests_and_keeps_serving(model_dir):
    engine = build_engine(model=str(model_dir))
    expected = engine.generate([_request(6, seed=1)])[0].token_ids
    original, calls = engine.step, [0]

    def step_failing_third_time() -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom")
        original()

    engine.step = step_failing_third_time
    h = Harness(engine, "failing")
    try:
        a, b = _request(50), _request(50, seed=2)
        h.send(P.Generate(a, False))
        h.send(P.Generate(b, True))
        got = h.recv_until(lambda g: _finished(a.rid)(g) and _finished(b.rid)(g))
        finals = {m.rid: m.delta.output for m in got if isinstance(m, P.Delta)
                  and m.delta.finished}
        for out in finals.values():
            assert out.finish_reason == FinishReason.ERROR
            assert out.error == "engine step failed: RuntimeError: boom"
        after = _request(6, seed=1)
        h.send(P.Generate(after, False))
        got = h.recv_until(_finished(after.rid))
        out = [m.delta.output for m in got if isinstance(m, P.Delta) and m.rid == after.rid][-1]
        assert out.finish_reason == FinishReason.LENGTH and out.token_ids == expected
        h.send(P.Call(9, "integrity"))
        reply = h.recv_until(lambda g: any(isinstance(m, P.Reply) for m in g))[-1]
        assert reply.ok and reply.value["kv_slots_used"] == 0 and reply.value["inflight"] == 0
    finally:
        h.close()


def test_encoder_handle_stays_in_the_worker(model_dir):
    """keep_encoder: the output carries an id-only view, the region stays held in the worker;
    a request passing that id reuses it (no encoder run), an unknown id is rejected, and
    ReleaseEncoder frees it (twice: only logged)."""
    engine = build_engine(model=str(model_dir))
    h = Harness(engine, "handles")
    try:
        out = h.keep(5)
        view = out.encoder_kv
        assert view.slots.numel() == 0 and view.id in engine.scheduler.held
        assert engine.scheduler.held[view.id].slots.numel() > 0
        encoded = engine.runner.num_encoded_inputs
        retry, unknown = _request(5), _request(5)
        retry.encoder_kv = view
        unknown.encoder_kv = dataclasses.replace(view, id=view.id + 1000)
        h.send(P.Generate(retry, False))
        h.send(P.Generate(unknown, False))
        got = h.recv_until(lambda g: _finished(retry.rid)(g)
                           and any(isinstance(m, P.Reject) for m in g))
        assert [m.delta.output.token_ids for m in got if isinstance(m, P.Delta)] == \
            [out.token_ids]
        assert engine.runner.num_encoded_inputs == encoded  # the held K/V, not a new encode
        assert [(m.rid, "not held" in m.message) for m in got if isinstance(m, P.Reject)] == \
            [(unknown.rid, True)]
        h.send(P.ReleaseEncoder(view.id))
        h.send(P.ReleaseEncoder(view.id))
        replies = h.call_replies(("integrity",), ("encoder",))
        assert replies[1].value["ok"] and replies[1].value["kv_slots_used"] == 0
        assert replies[2].value == {"held": 0, "encoded": encoded, "mels": 0}
    finally:
        h.close()
    engine.check_integrity()


def test_a_sibling_without_the_image_reuses_the_shared_region(tmp_path):
    """A chat's n choices under a worker: choice 0 (share_encoder) hands an id-only view over
    in its first delta; a sibling sent with that id and no image (a few KB on the wire, not
    the pixels) decodes over the held region: the tokens of a request with the image, no
    encoder run, and the release frees every slot."""
    pytest.importorskip("transformers")
    from edserve.chat.mllama_request import make_mllama_request
    from tests.models.mllama.hf_tiny import (
        build_hf_tiny,
        save_hf_tiny,
        save_word_tokenizer,
        synthetic_image,
    )

    folder = save_word_tokenizer(save_hf_tiny(build_hf_tiny(), tmp_path))
    engine = build_engine(model=str(folder), device="cpu", dtype="float32", context_length=64,
                          max_total_tokens=4096, max_running_requests=4)

    def request(seed: int, **kw) -> GenerateRequest:
        sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=6, ignore_eos=True)
        return dataclasses.replace(make_mllama_request(
            engine.model, [128, 1, 15, 13, 14], [synthetic_image(100, 50, 3)], sp), **kw)

    expected = [o.token_ids for o in engine.generate([request(1), request(2)])]
    h = Harness(engine, "share")
    try:
        owner = request(1, share_encoder=True)
        h.send(P.Generate(owner, True))
        got = h.recv_until(lambda g: any(isinstance(m, P.Delta)
                                         and m.delta.encoder_kv is not None for m in g))
        view = got[-1].delta.encoder_kv
        held = engine.scheduler.held[view.id]
        assert view.slots.numel() == 0 and held.slots.numel() > 0
        assert (view.encoder_len, view.enc_region) == (held.encoder_len, held.enc_region)
        encoded = engine.runner.num_encoded_inputs
        sibling = request(2, encoder_kv=view, encoder_input=None)
        sizes = [sum(len(f) for f in wire.encode(P.Generate(r, False)))
                 for r in (sibling, request(2, encoder_kv=view))]
        assert sizes[0] < 10_000 < 100_000 < sizes[1]  # the pixels stay behind
        h.send(P.Generate(sibling, False))
        got += h.recv_until(lambda g: _finished(owner.rid)(got + g)
                            and _finished(sibling.rid)(got + g))
        deltas = [m for m in got if isinstance(m, P.Delta)]
        assert not any(isinstance(m, P.Reject) for m in got)
        assert [t for m in deltas if m.rid == owner.rid for t in m.delta.token_ids] == \
            expected[0]
        [out] = [m.delta.output for m in deltas if m.rid == sibling.rid]
        assert out.finish_reason == FinishReason.LENGTH and out.token_ids == expected[1]
        assert engine.runner.num_encoded_inputs == encoded  # the held K/V, no vision run
        h.send(P.ReleaseEncoder(view.id))
        replies = h.call_replies(("integrity",), ("encoder",))
        assert replies[1].value["ok"] and replies[1].value["kv_slots_used"] == 0
        assert replies[2].value["held"] == 0 and replies[2].value["encoded"] == encoded
    finally:
        h.close()
    engine.check_integrity()
