"""Readouts: what the engine computes from a finished request's KV, asked for by a request
field and returned in the output (engine/readout.py)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch

from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine


@dataclass(frozen=True)
class EncoderKeys:
    """Layer ``layer``'s encoder keys of the finished row and the tokens it generated."""

    layer: int

    def read(self, kv, model):
        k, _ = kv.kv_pool.get_kv(self.layer)
        return k[kv.encoder_slots].float().clone(), list(kv.token_ids), type(model).__name__


class Broken:
    def read(self, kv, model):
        raise RuntimeError("cannot read")


def _request(readout=None, seed: int = 0) -> GenerateRequest:
    g = torch.Generator().manual_seed(seed)
    return GenerateRequest([50257], torch.randn(80, 3000, generator=g) * 0.5,
                           SamplingParams(max_new_tokens=4, ignore_eos=True), readout=readout)


def test_readout_result_comes_back_in_the_output(random_whisper):
    engine = build_engine(model=str(random_whisper))
    req = _request(EncoderKeys(1))
    assert pickle.loads(pickle.dumps(req)).readout == EncoderKeys(1)  # crosses processes
    plain, out = engine.generate([_request(), req])
    keys, tokens, model_name = out.readout
    assert plain.readout is None and tokens == out.token_ids == plain.token_ids
    assert keys.shape[0] == 1500 and torch.isfinite(keys).all() and keys.abs().sum() > 0
    assert model_name == type(engine.model).__name__
    assert req.on_finished_kv is None  # the caller's request is not changed
    engine.check_integrity()


def test_failing_or_conflicting_readouts(random_whisper):
    engine = build_engine(model=str(random_whisper))
    [out] = engine.generate([_request(Broken())])
    assert out.finish_reason == FinishReason.ERROR and "cannot read" in out.error
    both = _request(EncoderKeys(0))
    both.on_finished_kv = lambda kv: None
    with pytest.raises(ValueError, match="either a readout or an on_finished_kv"):
        engine.add_request(both, lambda d: None)
    with pytest.raises(ValueError, match="read\\(kv, model\\)"):
        engine.add_request(_request(object()), lambda d: None)
    assert not engine.has_work()


def test_readout_of_a_reuser_without_its_log_mel(random_whisper):
    """``encoder_kv`` without ``encoder_input``: the finished KV's encoder extent is the
    handle's, so a readout reads the same encoder keys as from the row that encoded them."""
    engine = build_engine(model=str(random_whisper))
    kept = _request(EncoderKeys(1))
    kept.keep_encoder = True
    [first] = engine.generate([kept])
    handle = first.encoder_kv
    reuser = _request(EncoderKeys(1))
    reuser.encoder_input, reuser.encoder_kv = None, handle
    [out] = engine.generate([reuser])
    keys, tokens, _ = out.readout
    assert keys.shape[0] == handle.encoder_len == 1500 and torch.equal(keys, first.readout[0])
    assert tokens == first.token_ids
    engine.release_encoder(handle)
    engine.step()
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0
