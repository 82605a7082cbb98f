"""``share_encoder``: a request's encoder region handed over in its first delta, while it runs
on (a chat's n choices share one vision run). At every page size and encoder-KV strategy a
sibling reusing the handle gives the tokens a fresh encode gives; the handle is held once,
released once, and no path (abort before the prefill, first-token finish, release while the
owner runs, a sibling still waiting on a released handle) leaks a page."""

from __future__ import annotations

import dataclasses

import pytest

from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.request import EncoderKV, FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine

pytest.importorskip("transformers")

from tests.models.mllama.hf_tiny import (  # noqa: E402
    build_hf_tiny,
    save_hf_tiny,
    save_word_tokenizer,
    synthetic_image,
)

PROMPT = [128, 1, 15, 13, 14]
STRATEGIES = [("flat", "128"), ("flat", "16"), ("aligned", "16"), ("ragged", "1")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = save_hf_tiny(build_hf_tiny(), tmp_path_factory.mktemp("share_mllama"))
    return save_word_tokenizer(folder)


def _engine(folder, strategy="flat", page_size="16"):
    return build_engine(model=str(folder), device="cpu", dtype="float32", encoder_kv=strategy,
                        page_size=page_size, context_length=64, max_total_tokens=4096,
                        max_running_requests=4, debug_checks=True)


def _request(engine, seed: int, steps: int = 6, image: bool = True, **kw) -> GenerateRequest:
    sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=steps, ignore_eos=True)
    req = make_mllama_request(engine.model, PROMPT if image else PROMPT[1:],
                              [synthetic_image(100, 50, 3)] if image else [], sp)
    return dataclasses.replace(req, **kw)


class Deltas:
    """Every delta of the requests added through it, by request id."""

    def __init__(self) -> None:
        self.by_rid: dict[str, list] = {}

    def add(self, engine, request: GenerateRequest, stream: bool = True) -> None:
        engine.add_request(request, self.by_rid.setdefault(request.rid, []).append, stream)

    def handles(self, rid: str) -> list:
        return [d.encoder_kv for d in self.by_rid[rid] if d.encoder_kv is not None]

    def output(self, rid: str):
        return self.by_rid[rid][-1].output


def _shared_after_prefill(engine, seen, **kw) -> tuple[GenerateRequest, EncoderKV]:
    """A share_encoder request (seed 1) added and prefilled: it and the handle its first
    delta carried."""
    owner = _request(engine, seed=1, share_encoder=True, **kw)
    seen.add(engine, owner)
    engine.step()
    return owner, seen.handles(owner.rid)[0]


def _drain(engine) -> None:
    while engine.has_work():
        engine.step()
        engine.check_integrity()


def _clean(engine) -> None:
    engine.step()
    engine.check_integrity()
    assert engine.scheduler.held == {} and engine.pools.allocator.num_used() == 0


@pytest.mark.parametrize("strategy,page_size", STRATEGIES)
def test_siblings_on_the_early_handle_equal_fresh_encodes(folder, strategy, page_size):
    engine = _engine(folder, strategy, page_size)
    fresh = engine.generate([_request(engine, seed=7 + i) for i in range(3)])
    encoded = engine.runner.num_encoded_inputs
    seen = Deltas()
    owner = _request(engine, seed=7, share_encoder=True)
    seen.add(engine, owner)
    while not seen.by_rid[owner.rid]:
        engine.step()
    first = seen.by_rid[owner.rid][0]
    assert not first.finished and len(first.token_ids) == 1
    handle = first.encoder_kv
    assert handle is not None and engine.scheduler.held == {handle.id: handle}
    siblings = [_request(engine, seed=7 + i, encoder_kv=handle) for i in (1, 2)]
    for s in siblings:
        seen.add(engine, s)
    _drain(engine)
    assert engine.runner.num_encoded_inputs == encoded + 1  # the owner's only
    assert seen.handles(owner.rid) == [handle]  # on the first delta only
    outs = [seen.output(r.rid) for r in (owner, *siblings)]
    assert [o.token_ids for o in outs] == [f.token_ids for f in fresh]
    assert all(o.encoder_kv is None for o in outs)  # not keep_encoder: the output has none
    assert engine.pools.allocator.num_used() > 0  # the region, held by the handle
    engine.release_encoder(handle)
    _clean(engine)


def test_release_while_the_owner_runs_and_sibling_reuse_then(folder):
    engine = _engine(folder)
    want = engine.generate([_request(engine, seed=1, steps=10), _request(engine, seed=2)])
    seen = Deltas()
    owner, handle = _shared_after_prefill(engine, seen, steps=10)
    sibling = _request(engine, seed=2, encoder_kv=handle)
    seen.add(engine, sibling)
    engine.step()  # the sibling is admitted (its row holds the region now)
    engine.release_encoder(handle)
    _drain(engine)
    assert [seen.output(r.rid).token_ids for r in (owner, sibling)] == \
        [w.token_ids for w in want]
    _clean(engine)


def test_handle_paths_that_end_early(folder):
    engine = _engine(folder)
    seen = Deltas()
    # aborted before its prefill: no handle anywhere
    early = _request(engine, seed=1, share_encoder=True)
    seen.add(engine, early)
    engine.abort(early.rid)
    # a first token that is the last: the final delta carries it
    one = _request(engine, seed=2, steps=1, share_encoder=True)
    seen.add(engine, one)
    # not streamed: the final delta carries it
    quiet = _request(engine, seed=3, share_encoder=True)
    seen.add(engine, quiet, stream=False)
    # text-only: nothing to share
    text = _request(engine, seed=4, image=False, share_encoder=True)
    seen.add(engine, text)
    # a delta nobody hears: the engine releases it itself
    engine.add_request(_request(engine, seed=5, share_encoder=True), None)
    _drain(engine)
    assert seen.output(early.rid).finish_reason == FinishReason.ABORT
    assert seen.handles(early.rid) == [] and seen.handles(text.rid) == []
    for r in (one, quiet):
        (delta,) = [d for d in seen.by_rid[r.rid] if d.encoder_kv is not None]
        assert delta.finished
        engine.release_encoder(delta.encoder_kv)
    _clean(engine)


def test_a_sibling_waiting_on_or_queued_after_a_released_handle_fails(folder):
    engine = _engine(folder)
    seen = Deltas()
    owner, handle = _shared_after_prefill(engine, seen)
    late = _request(engine, seed=2, encoder_kv=handle)
    seen.add(engine, late)
    engine._drain_inbox()  # the sibling is queued, not admitted yet
    engine.scheduler.release_encoder(handle)
    _drain(engine)
    out = seen.output(late.rid)
    assert out.finish_reason == FinishReason.ERROR and "released" in out.error
    later = _request(engine, seed=3, encoder_kv=handle)  # queued after the release
    seen.add(engine, later)
    _drain(engine)
    out = seen.output(later.rid)
    assert out.finish_reason == FinishReason.ERROR and "not held" in out.error
    _clean(engine)


def test_share_encoder_is_validated(folder):
    engine = _engine(folder)
    base = _request(engine, seed=1)
    for bad in (dict(share_encoder=1), dict(share_encoder=True, keep_encoder=True),
                dict(share_encoder=True, sampling=SamplingParams(temperature=1.0, best_of=2))):
        with pytest.raises(ValueError, match="share_encoder"):
            dataclasses.replace(base, **bad)


@pytest.mark.parametrize("strategy,page_size", STRATEGIES)
def test_a_sibling_without_the_image_reads_the_handle(folder, strategy, page_size):
    """``encoder_kv`` without ``encoder_input``: the encoder extent is the handle's; the
    tokens are those of a sibling that carries the image, and nothing is encoded again."""
    engine = _engine(folder, strategy, page_size)
    [fresh] = engine.generate([_request(engine, seed=2)])
    seen = Deltas()
    owner, handle = _shared_after_prefill(engine, seen, steps=10)
    with_image = _request(engine, seed=2, encoder_kv=handle)
    bare = _request(engine, seed=2, encoder_kv=handle, encoder_input=None)
    req = engine.make_req(bare)
    assert (req.encoder_len, req.enc_region) == (handle.encoder_len, handle.enc_region) != (0, 0)
    assert req.encoder_input is None
    encoded = engine.runner.num_encoded_inputs
    for r in (with_image, bare):
        seen.add(engine, r)
    _drain(engine)
    assert engine.runner.num_encoded_inputs == encoded
    outs = [seen.output(r.rid) for r in (with_image, bare)]
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH] * 2
    assert outs[1].token_ids == outs[0].token_ids == fresh.token_ids
    engine.release_encoder(handle)
    _clean(engine)


def test_a_keep_encoder_retry_without_the_image_and_mismatches(folder):
    engine = _engine(folder)
    [kept] = engine.generate([_request(engine, seed=3, keep_encoder=True)])
    handle = kept.encoder_kv
    encoded = engine.runner.num_encoded_inputs
    [retry] = engine.generate([_request(engine, seed=3, encoder_kv=handle, encoder_input=None)])
    assert retry.finish_reason == FinishReason.LENGTH and retry.token_ids == kept.token_ids
    assert engine.runner.num_encoded_inputs == encoded
    # an image given with the handle must agree with it (another size: other tile count)
    sp = SamplingParams(temperature=1.0, seed=3, max_new_tokens=6, ignore_eos=True)
    other = make_mllama_request(engine.model, PROMPT, [synthetic_image(50, 40, 3)], sp)
    assert engine.model.encoder_len(other.encoder_input) != handle.encoder_len
    with pytest.raises(ValueError, match="encoder_kv holds"):
        engine.make_req(dataclasses.replace(other, encoder_kv=handle))
    # without an image, the handle's region must be one of this engine's layout
    odd = dataclasses.replace(handle, enc_region=handle.enc_region + 1)
    with pytest.raises(ValueError, match="lays them out"):
        engine.make_req(dataclasses.replace(other, encoder_kv=odd, encoder_input=None))
    engine.release_encoder(handle)
    _clean(engine)
