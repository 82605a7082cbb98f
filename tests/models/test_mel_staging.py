"""Log-mels staged at submission (``edserve.models.mel_staging``) and the encoder warm-up
(``--encoder-warmup-max-bs``): the staged copy holds the same values and is counted against its
budget while alive; encoder outputs and tokens are the same staged or not; the warm-up runs
every batch size once and changes no output."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from edserve.audio.compact_mel import CompactMel
from edserve.config import EngineConfig
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.models.mel_staging import MelStager, as_tensor, host_finite, mels_to_device
from edserve.models.whisper import WhisperForConditionalGeneration
from edserve.runtime import build_engine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mels(n: int, bins: int = 80, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(bins, 3000, generator=gen) for _ in range(n)]


def _tokens(engine, mels, n_new: int = 4) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    outs = engine.generate([GenerateRequest([engine.tokenizer.sot], m, sp) for m in mels])
    return [o.token_ids for o in outs]


def test_stage_leaves_cpu_inputs_alone():
    stager, mel = MelStager(), _mels(1)[0]
    assert stager.stage(mel, torch.device("cpu")) is mel
    assert stager.staged_bytes == 0
    assert torch.equal(mels_to_device([mel, mel], torch.device("cpu")), torch.stack([mel, mel]))


def _compact(mel: torch.Tensor, head: int) -> CompactMel:
    """``mel`` with every column from ``head`` on set to one value, as a CompactMel window."""
    mel = mel.clone()
    mel[:, head:] = -0.5
    return CompactMel.of(mel.numpy()).window(0, mel.shape[1])


def test_a_compact_window_is_written_out_once_where_it_is_staged():
    compact = _compact(_mels(1)[0], 1100)
    assert compact.head.shape == (80, 1100) and compact.fill == np.float32(-0.5)
    want = compact.full()
    staged = MelStager().stage(compact, torch.device("cpu"))  # CPU: a plain tensor
    assert torch.is_tensor(staged) and torch.equal(staged, want)
    assert torch.equal(as_tensor(compact), want) and as_tensor(want) is want
    assert host_finite(compact) and host_finite(want)
    bad = want.clone()
    bad[0, 5] = float("inf")
    assert not host_finite(bad) and not host_finite(CompactMel.of(bad.numpy()))


def test_a_compact_window_gives_the_tensors_tokens_and_is_validated(random_whisper):
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2)
    mels = _mels(2, seed=3)
    compact = [_compact(m, 700 + 500 * i) for i, m in enumerate(mels)]
    assert _tokens(engine, compact) == _tokens(engine, [c.full() for c in compact])
    model = engine.model
    assert model.encoder_len(compact[0]) == model.config.max_source_positions
    nan = compact[0].head.copy()
    nan[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        model.encoder_len(CompactMel(nan, compact[0].fill, compact[0].frames))
    with pytest.raises(ValueError, match="shape"):
        model.encoder_len(compact[0].window(0, 2999))
    with pytest.raises(ValueError, match="floating-point"):
        model.encoder_len(CompactMel(compact[0].head.astype(np.int32), 0, 3000))


def test_a_copied_model_gets_its_own_stager():
    import copy
    import pickle

    stager = MelStager(max_bytes=123)
    stager.staged_bytes = 7
    for twin in (copy.deepcopy(stager), pickle.loads(pickle.dumps(stager))):
        assert twin is not stager and twin.max_bytes == 123 and twin.staged_bytes == 0


def test_warmup_option_is_checked():
    with pytest.raises(ValueError, match="encoder-warmup-max-bs must be >= 0"):
        EngineConfig(encoder_warmup_max_bs=-1)


def test_warmup_runs_every_batch_size_and_changes_nothing(random_whisper, monkeypatch):
    sizes: list[int] = []
    encode = WhisperForConditionalGeneration.encode

    def counting(self, inputs):
        sizes.append(len(inputs))
        return encode(self, inputs)

    kw = dict(model=str(random_whisper), device="cpu", max_running_requests=2)
    cold = _tokens(build_engine(**kw), _mels(2))
    monkeypatch.setattr(WhisperForConditionalGeneration, "encode", counting)
    warm = build_engine(**kw, encoder_warmup_max_bs=3)
    assert sizes == [] and warm.config.encoder_warmup_max_bs == 3  # on the stepping thread
    assert _tokens(warm, _mels(2)) == cold
    assert sizes == [1, 2, 3, 2]  # the first step warmed, then the real batch of 2
    warm.warm_up()
    assert sizes == [1, 2, 3, 2]  # once per thread
    other = threading.Thread(target=warm.warm_up)
    other.start()
    other.join()
    assert sizes == [1, 2, 3, 2, 1, 2, 3]  # cuDNN plans and cuBLAS handles are per thread
    assert build_engine(**kw).config.encoder_warmup_max_bs == 0  # CPU default: off


@pytest.mark.gpu
@needs_cuda
def test_staged_copy_is_pinned_counted_and_released():
    stager, mel = MelStager(max_bytes=2 * 80 * 3000 * 4), _mels(1)[0]
    dev = torch.device("cuda")
    a = stager.stage(mel, dev)
    assert a.is_pinned() and a is not mel and torch.equal(a, mel)
    assert stager.is_staged(a) and not stager.is_staged(mel)
    b = stager.stage(mel, dev)
    assert b.is_pinned() and stager.staged_bytes == 2 * mel.numel() * 4
    assert stager.stage(mel, dev) is mel  # over budget: left as it is
    assert stager.stage(a, dev) is a  # already pinned
    del a, b
    gc.collect()
    compact = _compact(mel, 1100)
    c = stager.stage(compact, dev)  # written out straight into the page-locked copy
    assert c.is_pinned() and stager.is_staged(c) and torch.equal(c, compact.full())
    del c
    gc.collect()
    assert stager.staged_bytes == 0


@pytest.mark.gpu
@needs_cuda
def test_staged_and_unstaged_give_the_same_encoder_output_and_tokens(random_whisper):
    engine = build_engine(model=str(random_whisper), device="cuda", max_running_requests=3)
    model, mels = engine.model, _mels(3, seed=1)
    staged = [model.stage_encoder_input(m) for m in mels]
    assert all(s.is_pinned() and model.inputs.stager.is_staged(s) for s in staged)
    with torch.inference_mode():
        assert all(torch.equal(x, y) for x, y in zip(model.encode(staged), model.encode(mels),
                                                     strict=True))
    with_staging = _tokens(engine, mels)
    model.inputs.stager.max_bytes = 0  # nothing staged: the step's own page-locked stack
    assert _tokens(engine, mels) == with_staging
