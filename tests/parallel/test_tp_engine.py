"""``--tensor-parallel-size 2`` on CPU: this process is rank 0 (engine, scheduler, KV
allocator), one follower process is rank 1, gloo between them. The follower is spawned once for
the module (the process group outlives each engine; a new engine re-builds the follower's
shard). Greedy tokens equal TP 1's on the tiny Mllama at every strategy and page size, for
image (1-4 tiles, two images, text before the image), text-only and beam-search requests; the
integrity check passes on every rank after each run."""

from __future__ import annotations

import pytest
import torch

import edserve.parallel
from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.engine import Engine
from edserve.engine.request import SamplingParams
from edserve.parallel.follower import Follower
from edserve.parallel.mirror import batch_from_message, batch_message, kv_digest
from edserve.runtime import build_engine
from tests.models.mllama.harness import make_pools, make_req
from tests.parallel.tiny_mllama import save_tiny_folder, tiny_cases, tiny_checkpoint

STEPS = 6
COMBOS = [(s, p) for s in ("aligned", "flat", "ragged") for p in (1, 16, 128)]


@pytest.fixture(scope="module")
def checkpoint():
    yield tiny_checkpoint()
    edserve.parallel.shutdown()  # the follower leaves; later modules start clean


def _engine(checkpoint, strategy: str, page_size: int, tp: int, device: str = "cpu") -> Engine:
    return build_engine(checkpoint=checkpoint, device=device, dtype="float32", encoder_kv=strategy,
                  page_size=str(page_size), context_length=64, max_total_tokens=4096,
                  max_running_requests=4, tensor_parallel_size=tp)


def _digest_halves(engine: Engine) -> list[torch.Tensor]:
    """The unsplit pool's digest, cut into the two ranks' heads."""
    return list(kv_digest(engine.pools.kv_pool).chunk(2, dim=1))


def _run(engine: Engine) -> tuple[list[list[int]], int]:
    """Greedy tokens of every case (4 rows at a time: several admission waves) plus a beam
    search request; and the KV copies (beam forks' copy-on-write) rank 0 made."""
    copies = []
    engine.pools.kv_pool.copy_observers.append(lambda src, dst: copies.append(len(src)))
    sp = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    cases = tiny_cases()
    reqs = [make_mllama_request(engine.model, p, imgs, sp) for p, imgs in cases]
    reqs.append(make_mllama_request(engine.model, [128, 1, 30, 31], cases[1][1],
                                    SamplingParams(max_new_tokens=STEPS, beam_size=2)))
    outs = engine.generate(reqs)
    engine.check_integrity()  # rank 0's pools, then every follower's report
    return [o.token_ids for o in outs], sum(copies)


def check_tp2_equals_tp1(checkpoint, strategy: str, page_size: int, device: str) -> None:
    """TP 2 vs TP 1 on ``device``: tokens, KV shards, the follower's call count, copies."""
    eng1 = _engine(checkpoint, strategy, page_size, 1, device)
    ref, _ = _run(eng1)
    eng = _engine(checkpoint, strategy, page_size, 2, device)
    assert eng.pools.kv_pool.num_kv_heads == 1  # rank 0 holds its half of the 2 kv heads
    assert eng.pools.kv_pool.num_slots == eng1.pools.kv_pool.num_slots
    tokens, copies = _run(eng)
    assert tokens == ref
    # Equal schedules write equal slots: each rank's KV shard (every slot, free ones too) holds
    # the unsplit pool's values of its heads, so no rank missed a write or a copy.
    for got, want in zip(eng.model.kv_digests(eng.pools.kv_pool), _digest_halves(eng1),
                         strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-3)
    assert eng.model.session.calls > 0  # the follower ran (and counted) every forward
    if page_size > 1:
        assert copies > 0  # the beam's forks copied partial pages on every rank


@pytest.mark.parametrize("strategy,page_size", COMBOS)
def test_tp2_tokens_equal_tp1(checkpoint, strategy, page_size):
    check_tp2_equals_tp1(checkpoint, strategy, page_size, "cpu")


def test_server_chat_tp2_equals_tp1(checkpoint, tmp_path):
    """``edserve serve --tensor-parallel-size 2``'s path: build() + uvicorn, the engine stepping
    on the AsyncEngine thread, every rank loading the folder itself; one image chat."""
    import httpx

    from edserve.config import EngineConfig
    from edserve.server.config import ServerConfig
    from edserve.server.launch import ServerThread, build
    from tests.models.mllama.chat_tiny import png_data_url

    folder = save_tiny_folder(checkpoint, tmp_path)
    body = {"model": "m", "max_tokens": STEPS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": png_data_url(100, 50)}},
                                     {"type": "text", "text": "describe the image"}]}]}
    texts = []
    for tp in (1, 2):
        aengine, app = build(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                          context_length=64, max_total_tokens=4096,
                                          tensor_parallel_size=tp),
                             ServerConfig(served_model_name="m"))
        srv = ServerThread(app, "127.0.0.1", 0).start()
        try:
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        finally:
            srv.stop()
            aengine.shutdown()
    assert texts[1] == texts[0] and texts[0]


def test_superseded_engine_refuses_to_step(checkpoint):
    old = _engine(checkpoint, "flat", 1, 2)
    _engine(checkpoint, "flat", 16, 2)  # re-builds the follower's shard
    req = make_mllama_request(old.model, [1, 5, 6], [], SamplingParams(max_new_tokens=2))
    out = old.generate([req])[0]  # the failing step fails its request, not the engine
    assert out.finish_reason.value == "error" and "replaced" in out.error
    with pytest.raises(ValueError, match="tensor-parallel-size must be >= 1"):
        _engine(checkpoint, "flat", 1, 0)


def test_follower_checks_catch_reads_of_unwritten_slots(checkpoint):
    """The follower's own integrity check (no process group: a mirrored batch round trip)."""
    from edserve.models.registry import build_model

    model = build_model(checkpoint, torch.float32, torch.device("cpu"))[0]
    pools = make_pools(model, "flat", 16)
    reqs = [make_req(model, pools, [1, 5, 6, 7], None, 4)]
    from edserve.engine.batch_builder import build_decode, build_prefill, release

    prefill = build_prefill(pools, reqs)
    decode = build_decode(pools, reqs)
    fresh = Follower(1, 2, torch.device("cpu"))
    for batch, errors in ((decode, 1), (prefill, 1), (decode, 1)):  # decode first: unwritten
        meta, tensors = batch_message(batch, torch.zeros(batch.num_tokens, dtype=torch.long),
                                      batch.positions, False)
        fresh._ensure_pool(meta["geometry"])
        _, _, mirrored = batch_from_message(meta, tensors, fresh.pool, fresh.backend)
        assert torch.equal(mirrored.req_to_token[0, :4],
                           pools.req_to_token_pool.req_to_token[reqs[0].req_pool_idx, :4])
        fresh._check_batch(mirrored)
        assert len(fresh.errors) == errors
    assert "reads 4 slots never written" in fresh.errors[0]
    release(pools, reqs)
