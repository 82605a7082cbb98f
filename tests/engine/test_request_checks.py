"""Bad requests fail at the door (construction or ``add_request``), never inside a step, and the
engine keeps serving afterwards (the root conftest checks KV integrity after each test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edserve.engine.logits_filter import LogitsRecorder
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper.logits import SuppressTokens

PROMPT = [50257, 50362]
MEL = torch.zeros(80, 3000)


@pytest.fixture(scope="module")
def engine(random_whisper):
    return build_engine(model=str(random_whisper), max_running_requests=2)


def test_plain_callable_processor_is_a_type_error_naming_the_contract():
    def old_style(generated, logits):  # the pre-filter interface: one row, Python loop
        logits[0] = -1e9

    with pytest.raises(TypeError, match=r"LogitsFilter.*apply\(logits \[n, V\], ctx"):
        GenerateRequest(PROMPT, MEL, logits_processors=[old_style])
    with pytest.raises(TypeError, match="list of LogitsFilter"):
        GenerateRequest(PROMPT, MEL, logits_processors=SuppressTokens((1,)))
    # Filters (and tuples of them) are accepted.
    GenerateRequest(PROMPT, MEL, logits_processors=(SuppressTokens((1,)), LogitsRecorder()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[]), "prompt_ids must not be empty"),
    (dict(prompt_ids="50257"), "prompt_ids must be a list"),
    (dict(prompt_ids=[50257, -1]), r"token ids \(integers >= 0\), got -1"),
    (dict(prompt_ids=[50257, 1.5]), "got 1.5"),
    (dict(prompt_ids=[True]), "got True"),
    (dict(sampling={"temperature": 0}), "sampling must be a SamplingParams"),
    (dict(no_speech_pos=0), "no_speech_pos and no_speech_token go together"),
    (dict(no_speech_pos=2, no_speech_token=1), r"prompt position in 0\.\.1, got 2"),
    (dict(no_speech_pos=0, no_speech_token=-3), "no_speech_token must be a token id"),
    (dict(cross_kv_ranges=[(0, 1)]), "one \\(start, end\\) pair per prompt token"),
    (dict(cross_kv_ranges=[(0, 1), (2, 1)]), "0 <= start <= end"),
    (dict(on_finished_kv=3), "on_finished_kv must be callable"),
    (dict(keep_encoder="yes"), "keep_encoder must be a bool"),
    (dict(encoder_kv="handle"), "encoder_kv must be an EncoderKV"),
    (dict(rid=""), "rid must be a non-empty string"),
])
def test_bad_fields_are_value_errors_at_construction(kwargs, match):
    fields = dict(prompt_ids=PROMPT, encoder_input=MEL) | kwargs
    with pytest.raises(ValueError, match=match):
        GenerateRequest(**fields)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(temperature=float("nan")), r"temperature must be in \[0, 2\]"),
    (dict(top_p=None), "top_p must be a number"),
    (dict(seed=1.0), "seed must be an integer or None"),
    (dict(max_new_tokens="8"), "max_new_tokens must be an integer or None"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids must hold token ids"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
    (dict(beam_size=True), "beam_size must be an integer"),
    (dict(beam_size=2, patience=float("inf")), r"patience must be in \(0, 100\]"),
    (dict(beam_size=2, patience=1e308), r"patience must be in \(0, 100\]"),
    (dict(beam_size=2, patience=0.1), r"round\(beam_size \* patience\) >= 1"),
    (dict(length_penalty="1"), "length_penalty must be a number"),
])
def test_bad_sampling_params_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_numbers_and_lists():
    sp = SamplingParams(temperature=np.float32(0.5), seed=np.int64(3), stop_token_ids=[7, 8],
                        max_new_tokens=np.int32(4))
    assert sp.stop_token_ids == (7, 8) and hash(sp)


def test_add_request_checks_what_the_model_knows(engine):
    vocab = engine.model.input_vocab_size
    assert vocab == 51864
    cases = [
        (GenerateRequest([50257, vocab], MEL), f"prompt_ids holds token id {vocab}"),
        (GenerateRequest(PROMPT, MEL, SamplingParams(stop_token_ids=(vocab + 5,))),
         "sampling.stop_token_ids holds token id"),
        (GenerateRequest(PROMPT, MEL, no_speech_pos=1, no_speech_token=10**6),
         "no_speech_token holds token id"),
        (GenerateRequest(PROMPT, MEL, cross_kv_ranges=[(0, 1500), (0, 1501)]),
         "cross_kv_ranges reach past the request's 1500 encoder tokens"),
    ]
    for request, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request(request)
    # A field set after construction is checked again at add_request.
    late = GenerateRequest(PROMPT, MEL)
    late.logits_processors = [lambda generated, logits: None]
    with pytest.raises(TypeError, match="LogitsFilter"):
        engine.add_request(late)
    assert not engine.has_work()
    # The engine is healthy: a good request (with a filter) still runs.
    [out] = engine.generate([GenerateRequest(PROMPT, MEL, SamplingParams(max_new_tokens=3),
                                             logits_processors=[SuppressTokens((1, 2))])])
    assert out.error is None and len(out.token_ids) >= 1
    engine.check_integrity()
