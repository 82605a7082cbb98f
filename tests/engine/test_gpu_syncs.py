"""On CUDA: a steady decode step with the transcription filters waits on the device at most
once (the step's token copy), counted with ``torch.cuda.set_sync_debug_mode``; and a finished
request is freed without a sync. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from cuda_syncs import count_syncs
from whisper_fixtures import make_random_whisper

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_decode_step_syncs_at_most_once(tmp_path, overlap):
    folder = make_random_whisper(tmp_path)
    engine = build_engine(model=str(folder), device="cuda", page_size="128", encoder_kv="flat",
                    max_running_requests=8, overlap_schedule=overlap, debug_checks=False)
    tok = engine.tokenizer
    procs = [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok)),
             ApplyTimestampRules.of(tok)]
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        mel = (torch.randn(80, 3000, generator=gen) * 0.5).cuda()
        sp = SamplingParams(max_new_tokens=30 + i, ignore_eos=True,
                            temperature=0.7 if i % 2 else 0.0, seed=i)
        engine.add_request(GenerateRequest([tok.sot], mel, sp, logits_processors=list(procs)))
    assert count_syncs(lambda: torch.ones(1, device="cuda").item()) == 1  # the probe works
    for _ in range(4):  # prefill + first decode steps (graph replay warmed up)
        engine.step()
    steps = 10
    syncs = count_syncs(lambda: [engine.step() for _ in range(steps)])
    assert syncs <= steps, f"{syncs} syncs in {steps} decode steps"
    while engine.has_work():  # requests finish one by one: frees must not sync either
        n = count_syncs(engine.step)
        assert n <= 1
    engine.check_integrity()
