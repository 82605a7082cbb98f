"""Real speech through the embedded tiny.en: known transcripts, HF greedy parity, every strategy."""

from __future__ import annotations

import pytest
import torch
from whisper_fixtures import CLIPS, DATA, TINY_EN_TEXT, hf_greedy, tiny_en_folder

from edserve.audio.decode import load_audio
from edserve.audio.mel import whisper_features
from edserve.runtime import build_engine
from edserve.whisper.transcribe import transcribe


@pytest.fixture(scope="module")
def audios():
    return [load_audio(DATA / f"{c}.wav") for c in CLIPS]


@pytest.fixture(scope="module")
def hf_tokens(audios):
    """HF WhisperForConditionalGeneration on the same CT2 weights (float32), greedy."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from edserve.models.weights import load_checkpoint

    ckpt = load_checkpoint(tiny_en_folder())
    model = WhisperForConditionalGeneration(WhisperConfig(**ckpt.config)).eval()
    model.load_state_dict({k: v.float() for k, v in ckpt.state_dict.items()}, strict=False)
    model.tie_weights()
    return [hf_greedy(model, whisper_features(a, 80), [50257, 50362], 100, eos=50256)[0]
            for a in audios]


def test_default_engine_transcribes_jfk():
    engine = build_engine()
    [result] = transcribe(engine, [DATA / "jfk.wav"])
    assert result.text == TINY_EN_TEXT
    engine.check_integrity()


@pytest.mark.parametrize("strategy,page_size", [("flat", "1"), ("aligned", "128"),
                                                 ("ragged", "64"), ("flat", "16")])
def test_clips_match_hf_greedy_tokens(audios, hf_tokens, strategy, page_size):
    engine = build_engine(encoder_kv=strategy, page_size=page_size, max_running_requests=3)
    from edserve.engine.request import GenerateRequest

    reqs = [GenerateRequest([50257, 50362], whisper_features(a, 80)) for a in audios]
    outs = engine.generate(reqs)
    for out, ref in zip(outs, hf_tokens, strict=True):
        assert out.token_ids == ref
    assert engine.tokenizer.decode(outs[0].token_ids).strip() == TINY_EN_TEXT
    engine.check_integrity()
    assert engine.pools.allocator.available_size() == engine.pools.allocator.size
    assert torch.is_tensor(engine.pools.req_to_token_pool.req_to_token)
