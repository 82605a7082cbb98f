"""Beam search and best_of on CUDA (Triton kernels, CUDA graphs, float32): a small random
Whisper gives the same beams as the CPU float32 engine (torch ops) under flat:128 and
aligned:128, best_of's returned tokens score as the CPU model scores them, the KV pools stay
consistent, and a beam decode step waits on the device at most a few times (counted with
``torch.cuda.set_sync_debug_mode``; the host decides which beams continue, so about one sync a
step is expected). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from cuda_syncs import sync_sites
from whisper_fixtures import make_random_whisper

from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper.logits import SuppressBlank, SuppressTokens, default_suppress_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
PROMPT = [50257, 50362]  # <|startoftranscript|><|notimestamps|>
BEAM = 5
STEPS = 12
CONFIGS = [("flat", "128"), ("aligned", "128")]
SYNCS_PER_STEP_BOUND = 3


@pytest.fixture(scope="module", autouse=True)
def true_fp32():
    """cuDNN's convolutions (the encoder's stem) default to TF32: keep them in float32."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("gpu_beam_whisper"))


@pytest.fixture(scope="module")
def mels():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(3)]


def _engine(folder, device: str, strategy: str, page_size: str, **kw) -> Engine:
    cuda = device.startswith("cuda")
    return build_engine(model=str(folder), device=device, dtype="float32", encoder_kv=strategy,
                  page_size=page_size, attention_backend="triton" if cuda else "torch",
                  max_running_requests=16,  # pools sized by tokens: tests build several engines
                  **{"cuda_graph": cuda, "max_total_tokens": 65536, **kw})


def _filters(tok):
    return [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok))]


def _beam_batch(tok, mels, device: str) -> list[GenerateRequest]:
    """Three beam-5 requests (EOS allowed) and one greedy request in the same batch."""
    reqs = [GenerateRequest(list(PROMPT), m.to(device), SamplingParams(
        beam_size=BEAM, max_new_tokens=STEPS), logits_processors=_filters(tok)) for m in mels]
    reqs.append(GenerateRequest(list(PROMPT), mels[0].to(device), SamplingParams(
        max_new_tokens=STEPS), logits_processors=_filters(tok)))
    return reqs


def _run_checked(engine: Engine, reqs: list[GenerateRequest]):
    """generate(), with the integrity check after every step; all KV freed at the end."""
    outs = {}
    for r in reqs:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished
                           else None, stream=False)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0
    return [outs[r.rid] for r in reqs]


def _score(out) -> float:
    return out.sum_logprob + (out.stop_logprob or 0.0)


@pytest.fixture(scope="module")
def cpu_beams(folder, mels):
    refs = {}
    for strategy, ps in CONFIGS:
        engine = _engine(folder, "cpu", strategy, ps)
        refs[strategy, ps] = _run_checked(engine, _beam_batch(engine.tokenizer, mels, "cpu"))
    return refs


@pytest.mark.parametrize("strategy,page_size", CONFIGS)
def test_beam_cuda_matches_cpu(folder, mels, cpu_beams, strategy, page_size):
    engine = _engine(folder, DEVICE, strategy, page_size)
    assert engine.runner.graph_runner is not None  # decode steps replay CUDA graphs
    outs = _run_checked(engine, _beam_batch(engine.tokenizer, mels, DEVICE))
    graphs = engine.scheduler.beams.graphs  # the beam steps' work replayed as CUDA graphs
    assert graphs is not None and graphs.captures >= 1 and graphs.replays >= 3
    for i, (got, want) in enumerate(zip(outs, cpu_beams[strategy, page_size], strict=True)):
        assert got.error is None, got.error
        if got.token_ids != want.token_ids:  # only a near tie of the ranked scores may differ
            assert abs(_score(got) - _score(want)) < 5e-3, (
                f"request {i}: {got.token_ids} (score {_score(got):.5f}) != CPU "
                f"{want.token_ids} (score {_score(want):.5f})")
            continue
        assert got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        assert _score(got) == pytest.approx(_score(want), abs=1e-3)


@pytest.fixture(scope="module")
def hf_cpu(folder):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(folder).eval()


def _hf_logprobs(model, mel: torch.Tensor, tokens: list[int]) -> list[float]:
    """Log-probabilities of ``tokens`` after PROMPT under the HF model on the CPU (float32)."""
    ids = torch.tensor([PROMPT + tokens[:-1]])
    with torch.no_grad():
        logits = model(input_features=mel[None], decoder_input_ids=ids).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[len(PROMPT) - 1:]
    return [lp[j, t].item() for j, t in enumerate(tokens)]


@pytest.mark.parametrize("strategy,page_size", CONFIGS)
def test_best_of_cuda_scores_as_cpu_model(folder, mels, hf_cpu, strategy, page_size):
    """Seeded draws come from per-request CUDA generators (other streams than the CPU's), so
    the tokens differ from a CPU run; instead: the run repeats exactly, and the returned
    sample's log-probabilities are those of the CPU model (no filters: plain log-softmax)."""
    engine = _engine(folder, DEVICE, strategy, page_size)

    def batch():
        return [GenerateRequest(list(PROMPT), m.to(DEVICE), SamplingParams(
            temperature=0.7, best_of=5, seed=11 + i, max_new_tokens=STEPS, ignore_eos=True))
            for i, m in enumerate(mels[:2])]

    first = _run_checked(engine, batch())
    again = _run_checked(engine, batch())
    for a, b, mel in zip(first, again, mels[:2], strict=True):
        assert a.error is None, a.error
        assert len(a.token_ids) == STEPS
        assert a.token_ids == b.token_ids  # seeded: deterministic on CUDA too
        assert a.sum_logprob == pytest.approx(sum(a.logprobs), abs=1e-4)
        assert a.logprobs == pytest.approx(_hf_logprobs(hf_cpu, mel, a.token_ids), abs=2e-3)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_beam_decode_step_syncs(folder, mels, overlap):
    engine = _engine(folder, DEVICE, "flat", "128", overlap_schedule=overlap,
                     debug_checks=False)
    tok = engine.tokenizer
    for m in mels:
        engine.add_request(GenerateRequest(list(PROMPT), m.to(DEVICE), SamplingParams(
            beam_size=BEAM, max_new_tokens=40, ignore_eos=True), logits_processors=_filters(tok)))
    assert sum(sync_sites(lambda: torch.ones(1, device=DEVICE).item()).values()) == 1  # probe
    for _ in range(4):  # prefill, forks, graph replays warmed up
        engine.step()
    assert len(engine.scheduler.running) == BEAM * len(mels)
    steps = 10
    where = sync_sites(lambda: [engine.step() for _ in range(steps)])
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    syncs = sum(where.values())
    if overlap == "on":  # the 10 steps replayed the beam work as graphs
        assert engine.scheduler.beams.graphs.replays >= steps - 2
    print(f"\nbeam {BEAM} x {len(mels)} requests, overlap {overlap}: {syncs} syncs in {steps} "
          f"decode steps ({syncs / steps:.1f} per step); where: {dict(where.most_common())}")
    assert syncs <= SYNCS_PER_STEP_BOUND * steps, (
        f"{syncs} syncs in {steps} decode steps: {dict(where.most_common())}")


def _assert_same_beams(outs, refs, what: str) -> None:
    for i, (got, want) in enumerate(zip(outs, refs, strict=True)):
        assert got.error is None, got.error
        if got.token_ids != want.token_ids:  # only a near tie of the ranked scores may differ
            assert abs(_score(got) - _score(want)) < 5e-3, (
                f"{what}, request {i}: {got.token_ids} (score {_score(got):.5f}) != "
                f"{want.token_ids} (score {_score(want):.5f})")
            continue
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


@pytest.mark.parametrize("strategy,page_size", CONFIGS)
def test_grouped_cross_attention_graphs_match_eager(folder, mels, strategy, page_size):
    """Decode replayed from CUDA graphs with the grouped cross-attention kernel (one encoder
    read per beam group; the padded group table in the graph's static buffers) gives the
    beams of the eager path and of the per-row reads inside graphs."""
    def run(**kw):
        engine = _engine(folder, DEVICE, strategy, page_size, **kw)
        return engine, _run_checked(engine, _beam_batch(engine.tokenizer, mels, DEVICE))

    graphed, outs = run()
    assert graphed.runner.graph_runner is not None and graphed.runner.graph_runner.inputs.grouped
    eager, eager_outs = run(cuda_graph=False)
    assert eager.runner.graph_runner is None and eager.pools.backend.grouped_cross
    per_row, per_row_outs = run(grouped_cross_attention=False)
    assert not per_row.runner.graph_runner.inputs.grouped
    _assert_same_beams(outs, eager_outs, "graphs vs eager")
    _assert_same_beams(outs, per_row_outs, "grouped vs per-row reads")
