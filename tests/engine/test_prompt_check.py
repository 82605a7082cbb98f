"""Prompt checks (:mod:`edserve.engine.prompt_check`): a guessed prompt token scored and
checked by the prefill, on a random Whisper, eagerly and through the prompt replays.

The oracle is the engine itself without the check: the scores equal the log-softmax over the
choices of the logits at the checked position (read through a request that samples its first
token there), a right guess leaves the tokens unchanged, and a wrong one ends after its prefill
with the encoder kept, so a retry with the right token gives the unchecked request's tokens
without a second encoder pass.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edserve.engine.cuda_graph import capture_sizes
from edserve.engine.graph_inputs import GraphInputs, static_forward
from edserve.engine.prompt_check import PromptCheck
from edserve.engine.prompt_graphs import PromptReplayer
from edserve.engine.request import FinishReason, GenerateRequest, SamplingParams
from edserve.runtime import build_engine

SOT, TASK, NO_TS = 50257, 50358, 50362
CHOICES = tuple(range(50258, 50270))  # stand-ins for the language tokens


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def _engine(random_whisper, replays: bool, device: str = "cpu"):
    engine = build_engine(model=str(random_whisper), page_size="16", dtype="float32",
                          encoder_kv="flat", max_running_requests=8, device=device,
                          max_total_tokens=65536)  # on CUDA: leave the GPU to other tests
    if replays:  # the replays a DecodeGraphRunner makes, graphs run eagerly (CPU)
        pools = engine.pools
        inputs = GraphInputs(8, engine.device, ranged=False,
                             grouped=pools.backend.grouped_cross)
        engine.runner.graph_runner = SimpleNamespace(
            prompts=PromptReplayer(inputs, capture_sizes(8),
                                   lambda n: static_forward(engine.model, pools, inputs, n), 8),
            can_run=lambda batch, plan=None: False)
    return engine


def _mel(seed: int) -> torch.Tensor:
    return torch.randn(80, 3000, generator=torch.Generator().manual_seed(seed)) * 0.5


def _req(prompt, seed, check=None, **kw):
    sp = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 4), ignore_eos=True, **kw)
    return GenerateRequest(list(prompt), _mel(seed), sp, prompt_check=check)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("replays", [False, True])
def test_checks_score_decide_and_keep_the_encoder(random_whisper, replays, device):
    """On CUDA, ``replays=False`` is the engine's own prompt graphs (captured CUDA graphs)."""
    engine = _engine(random_whisper, replays, device)
    # what the prefill sees at <|startoftranscript|>: a request that samples its first token
    # there, restricted to the choices by a stop after one token
    from edserve.whisper.language import DetectLanguage

    probe = GenerateRequest([SOT], _mel(1), SamplingParams(max_new_tokens=1),
                            logits_processors=[DetectLanguage(CHOICES)])
    first = engine.generate([probe])[0]
    best, best_lp = first.token_ids[0], first.logprobs[0]
    wrong = next(c for c in CHOICES if c != best)

    right_prompt, wrong_prompt = [SOT, best, TASK, NO_TS], [SOT, wrong, TASK, NO_TS]
    plain = engine.generate([_req(right_prompt, 1)])[0]
    check = PromptCheck(0, CHOICES)
    enc0 = engine.runner.num_encoded_inputs
    ok, bad = engine.generate([_req(right_prompt, 1, check), _req(wrong_prompt, 1, check)])
    assert engine.runner.num_encoded_inputs == enc0 + 2
    for out in (ok, bad):
        assert out.prompt_check[0] == best
        assert out.prompt_check[1] == pytest.approx(best_lp, abs=1e-5)
    assert ok.token_ids == plain.token_ids and ok.finish_reason == FinishReason.LENGTH
    assert ok.logprobs == pytest.approx(plain.logprobs, abs=1e-4) and ok.encoder_kv is None
    assert bad.finish_reason == FinishReason.STOP and bad.token_ids == []
    handle = bad.encoder_kv
    assert handle is not None and handle.id in engine.scheduler.held
    engine.check_integrity()
    retry = GenerateRequest(right_prompt, _mel(1), plain_sampling(), encoder_kv=handle)
    again = engine.generate([retry])[0]
    assert engine.runner.num_encoded_inputs == enc0 + 2  # the encoder ran once per input
    assert again.token_ids == plain.token_ids
    engine.release_encoder(handle)
    engine.step()  # the release is applied at the next step
    assert not engine.scheduler.held and engine.pools.allocator.available_size() == \
        engine.pools.allocator.size


def plain_sampling() -> SamplingParams:
    return SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_a_check_beside_a_beam_group_leaves_the_beams_alone(random_whisper):
    """A prefill step with a checked row and a beam group's leader: both outputs as alone
    (the step's host copy holds checks and beam candidates side by side)."""
    engine = _engine(random_whisper, replays=False)
    beam = _req([SOT, 50259, TASK, NO_TS], 4, beam_size=3)
    checked = _req([SOT, 50259, TASK, NO_TS], 5, PromptCheck(0, CHOICES))
    alone = [engine.generate([_req(beam.prompt_ids, 4, beam_size=3)])[0],
             engine.generate([_req(checked.prompt_ids, 5, PromptCheck(0, CHOICES))])[0]]
    together = engine.generate([beam, checked])
    for a, t in zip(alone, together, strict=True):
        assert (t.token_ids, t.finish_reason) == (a.token_ids, a.finish_reason)
    assert together[1].prompt_check[0] == alone[1].prompt_check[0]
    assert together[1].prompt_check[1] == pytest.approx(alone[1].prompt_check[1], abs=1e-5)
    assert together[0].prompt_check is None and together[1].prompt_check is not None


@pytest.mark.parametrize("check,prompt,kw,message", [
    (PromptCheck(3, CHOICES), [SOT, 50258, TASK, NO_TS], {}, "prompt position in 0..2"),
    (PromptCheck(0, ()), [SOT, 50258], {}, "non-empty tuple"),
    (PromptCheck(0, CHOICES), [SOT, TASK], {}, "is not one of"),
    (PromptCheck(0, CHOICES), [SOT, 50258], {"beam_size": 2}, "single-row"),
    ("en", [SOT, 50258], {}, "must be a PromptCheck"),
])
def test_bad_checks_are_refused(check, prompt, kw, message):
    with pytest.raises(ValueError, match=message):
        GenerateRequest(prompt, None, SamplingParams(**kw), prompt_check=check)


def test_choices_outside_the_vocabulary_are_refused(random_whisper):
    engine = _engine(random_whisper, replays=False)
    req = _req([SOT, 50258], 1, PromptCheck(0, (50258, 10 ** 6)))
    with pytest.raises(ValueError, match="prompt_check.choices holds token id"):
        engine.add_request(req, None)
    engine.check_integrity()
