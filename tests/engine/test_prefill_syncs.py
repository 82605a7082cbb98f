"""A prefill step never reads a device value on the host (no ``.item()``, ``.tolist()``,
``if tensor``, ...), so with overlap scheduling the host builds the next step while the encoder
runs. On CPU this is checked structurally: the tensor methods that would wait for a device raise
while ``schedule()`` and ``run()`` build and launch a prefill step (mixed with decoding rows,
Whisper's transcription filters, the no-speech probability). The attention ops are exempt: the
torch reference ops size their gathers on the host by design, the Triton kernels used on CUDA
do not (the GPU test in this file counts real syncs of whole engine steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_syncs import count_syncs
from host_reads import HostRead, host_reads_raise
from whisper_fixtures import make_random_whisper

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.layers.forward_batch import ForwardMode
from edserve.runtime import build_engine
from edserve.whisper.logits import (
    ApplyTimestampRules,
    SuppressBlank,
    SuppressTokens,
    default_suppress_tokens,
)


def _request(tok, mel, **sampling):
    procs = [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok)),
             ApplyTimestampRules.of(tok)]
    return GenerateRequest([tok.sot, tok.sot + 1, tok.sot + 2], mel,
                           SamplingParams(max_new_tokens=6, **sampling),
                           logits_processors=procs, no_speech_pos=0,
                           no_speech_token=tok.sot + 1)


def test_prefill_steps_read_nothing_from_the_device(random_whisper, monkeypatch):
    engine = build_engine(model=str(random_whisper), page_size="16", encoder_kv="flat",
                    max_running_requests=8, debug_checks=False, overlap_schedule="on")
    engine.pools.kv_pool.check_indices = False  # as on CUDA (a CPU-only bounds check)
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(4)]
    outs = {}

    def submit(mel, **sampling):
        engine.add_request(_request(tok, mel, **sampling),
                           lambda d: outs.__setitem__(d.rid, d.output) if d.finished else None)

    def checked_step(mode, num_decode):
        with host_reads_raise(monkeypatch, engine.pools.backend):
            sched = engine.scheduler.schedule()
            output = engine.runner.run(sched)
        assert sched.mode == mode and sched.num_decode == num_decode
        engine.scheduler.update(sched, output)  # the step's one sync: its tokens

    with host_reads_raise(monkeypatch, engine.pools.backend):  # the probe works
        with pytest.raises(HostRead):
            torch.ones(2).sum().item()
    submit(mels[0])
    submit(mels[1], temperature=0.7, seed=3)
    engine._drain_inbox()
    checked_step(ForwardMode.EXTEND, 0)  # a prefill step alone
    checked_step(ForwardMode.DECODE, 0)
    submit(mels[2])
    submit(mels[3], temperature=0.5, seed=4)
    engine._drain_inbox()
    checked_step(ForwardMode.EXTEND, 2)  # a mixed step: two decoding rows + two arrivals
    while engine.has_work():
        engine.step()
    assert len(outs) == 4 and all(o.error is None for o in outs.values())
    assert all(o.no_speech_prob is not None for o in outs.values())


def test_nonfinite_log_mel_is_refused_at_submission(random_whisper):
    engine = build_engine(model=str(random_whisper), max_running_requests=2)
    mel = torch.zeros(80, 3000)
    mel[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        engine.add_request(GenerateRequest([50257], mel))
    for dtype in (torch.float16, torch.bfloat16):  # numpy reads float16; torch reads bfloat16
        inf = torch.zeros(80, 3000, dtype=dtype)
        inf[79, 2999] = float("-inf")
        with pytest.raises(ValueError, match="NaN or infinite"):
            engine.add_request(GenerateRequest([50257], inf))
    with pytest.raises(ValueError, match="floating-point log-mel"):
        engine.add_request(GenerateRequest([50257], torch.zeros(80, 3000, dtype=torch.int64)))


def test_nonfinite_audio_array_is_refused_before_the_engine():
    from edserve.audio.errors import NonFiniteAudioError
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    audio = np.zeros(16000, dtype=np.float32)
    audio[123] = np.inf
    with pytest.raises(NonFiniteAudioError):
        transcribe(object(), [audio], options=TranscribeOptions())  # the engine is never used


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixed", [True, False])
def test_prefill_step_syncs_at_most_once(tmp_path, mixed):
    """Host log-mels (the server's case): a prefill step, alone or mixed with decoding rows,
    waits on the device at most once (the previous step's token copy, with overlap)."""
    folder = make_random_whisper(tmp_path)
    engine = build_engine(model=str(folder), device="cuda", page_size="128", encoder_kv="flat",
                    max_running_requests=16, overlap_schedule="on", debug_checks=False,
                    mixed_steps=mixed)
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        engine.add_request(_request(tok, torch.randn(80, 3000, generator=gen)))
    for _ in range(3):  # prefill + decode steps (graphs warmed up)
        engine.step()
    for _ in range(4):  # arrivals while the first four decode
        engine.add_request(_request(tok, torch.randn(80, 3000, generator=gen)))
    engine._drain_inbox()  # (submission validates on the host: not part of the step)
    syncs = count_syncs(engine.step)
    assert syncs <= 1, f"{syncs} syncs in a prefill step"
    while engine.has_work():
        engine.step()
    engine.check_integrity()
