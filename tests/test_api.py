"""The top-level API, used as a newcomer would: everything imported from ``edserve`` itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import edserve
from edserve import (
    Engine,
    EngineConfig,
    GenerateRequest,
    SamplingParams,
    Transcription,
    VisionChat,
    Whisper,
    build_engine,
    load,
)

DATA = Path(__file__).parent / "data"
JFK = "And so my fellow Americans ask not what your country can do for you"


@pytest.fixture(scope="module")
def whisper():
    return Whisper(device="cpu", max_running_requests=4)


def test_import_is_light_and_lists_the_api():
    assert {"Whisper", "load", "Engine", "EngineConfig", "build_engine", "SamplingParams",
            "GenerateRequest", "VisionChat", "TranscribeOptions"} <= set(edserve.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        edserve.Nope  # noqa: B018


def test_whisper_transcribes_one_path_or_a_list(whisper):
    one = whisper.transcribe(str(DATA / "jfk.wav"), beam_size=1)
    assert isinstance(one, Transcription) and one.text.startswith(JFK)
    assert one.language == "en" and one.segments and one.duration == pytest.approx(11, abs=0.1)
    audio = np.zeros(16000, dtype=np.float32)  # 1 s of silence as an array
    both = whisper.transcribe([DATA / "jfk.wav", audio], beam_size=1)
    assert [r.text for r in both][0] == one.text and isinstance(both, list) and len(both) == 2


def test_whisper_options_by_name(whisper):
    r = whisper.transcribe(DATA / "jfk.wav", beam_size=1, word_timestamps=True,
                           condition_on_previous_text=True)
    assert r.words and r.words[0].word.strip() == "And" and r.words[0].end > r.words[0].start
    with pytest.raises(TypeError, match="no_such_option"):
        whisper.transcribe(DATA / "jfk.wav", no_such_option=1)


def test_load_picks_the_front_door_and_engines_build_from_the_root():
    model = load(device="cpu", max_running_requests=2)
    assert isinstance(model, Whisper) and model.is_multilingual is False
    with pytest.raises(ValueError, match="VisionChat serves mllama"):
        VisionChat(engine=model.engine)
    engine = build_engine(EngineConfig(device="cpu", max_running_requests=2))
    assert isinstance(engine, Engine) and engine.config.max_running_requests == 2
    prompt = engine.tokenizer.sot_sequence(language="en", task="transcribe", timestamps=False)
    req = GenerateRequest(prompt_ids=prompt,
                          encoder_input=torch.zeros(80, 3000),
                          sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
    [out] = engine.generate([req])
    assert len(out.token_ids) == 3


def test_vision_chat_on_a_tiny_mllama(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.mllama.chat_tiny import png_data_url, save_chat_model

    folder = save_chat_model(tmp_path / "mllama")
    chat = load(str(folder), device="cpu", dtype="float32", context_length=128,
                max_running_requests=2)
    assert isinstance(chat, VisionChat)
    msg = [{"role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": png_data_url(60, 40)}},
                                        {"type": "text", "text": "describe the image"}]}]
    result = chat.chat(msg, max_tokens=4)
    assert result.completion_tokens == 4 or result.finish_reason == "stop"
    assert result.prompt_tokens > 0
