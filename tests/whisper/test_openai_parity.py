"""edserve against the official openai-whisper 20250625 on the same weights (float32 CPU).

``--mel-padding zeros`` is openai-whisper ``transcribe()``'s window layout, so edserve must give
its tokens exactly: greedy and beam 5 (tiny.en), word text and times (base), the detected
language (base, espeak clips), and a long-form clip over 30 s with timestamps. The default
``silence`` layout must give ``whisper.decode``'s tokens on ``log_mel_spectrogram(pad_or_trim(
audio))`` (openai-whisper's README example). The clips are ones where the two layouts give
different text, so each comparison also shows that the switch is what makes the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import whisper  # the official openai-whisper package (the test extra)

from edserve.audio.decode import load_audio
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe
from tests.whisper.openai_oracle import load_openai_whisper

DATA = Path(__file__).resolve().parents[1] / "data"
# tiny.en: the layouts give different text on alsa_Front_Left, cards_005 (greedy) and
# librivox_0880 (beam 5), the same on the others
GREEDY_CLIPS = ["alsa_Front_Left", "cards_005", "librivox_0880"]
BEAM_CLIPS = ["alsa_Rear_Right", "librivox_0880"]
WORD_CLIPS = ["librivox_0870"]
LONG_CLIPS = ["jfk", "librivox_0880", "cards_005", "jfk", "alsa_Rear_Right", "librivox_0880"]
LANGUAGE_CLIPS = {"espeak_de": "de", "espeak_es": "es"}
TIME_TOL = 0.01 + 1e-9  # s: word times are rounded to 10 ms by both


def _path(name: str) -> Path:
    return DATA / f"{name}.wav"


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """``oracle(name)``: openai-whisper on edserve's ``tiny.en`` / ``base`` weights (converted
    once per session, under a temporary folder)."""
    folder, models = tmp_path_factory.mktemp("openai_whisper"), {}

    def get(name: str):
        if name not in models:
            models[name] = load_openai_whisper(name, folder / f"{name}.pt")
        return models[name]

    return get


@pytest.fixture(scope="module")
def audio():
    return {n: load_audio(_path(n)) for n in
            {*GREEDY_CLIPS, *BEAM_CLIPS, *WORD_CLIPS, *LONG_CLIPS, *LANGUAGE_CLIPS}}


@pytest.fixture(scope="module")
def tiny():
    return build_engine(device="cpu", max_running_requests=10)


@pytest.fixture(scope="module")
def base():
    return build_engine(model="base", device="cpu", max_running_requests=4)


def _ours(engine, audios: list[np.ndarray], **opts):
    return transcribe(engine, audios, options=TranscribeOptions(temperatures=(0.0,), **opts))


@pytest.fixture(scope="module")
def silence(tiny, audio):
    """``silence(beam_size, clips)``: tiny.en's results in the default layout, computed once
    per (beam size, clips) (two tests read the greedy ones)."""
    results = {}

    def get(beam_size: int, clips: list[str]):
        key = (beam_size, tuple(clips))
        if key not in results:
            results[key] = _ours(tiny, [audio[c] for c in clips], beam_size=beam_size)
        return results[key]

    return get


def _theirs(model, audio: np.ndarray, beam_size: int = 1, **opts) -> dict:
    """``whisper.transcribe`` as edserve decodes: temperature 0 only, no conditioning on the
    previous window, float32."""
    return whisper.transcribe(model, audio, temperature=0.0, condition_on_previous_text=False,
                              fp16=False, beam_size=beam_size if beam_size > 1 else None, **opts)


def _tokens(segments) -> list[list[int]]:
    """Per kept segment, its tokens (openai-whisper empties segments edserve drops)."""
    out = []
    for s in segments:
        tokens = s["tokens"] if isinstance(s, dict) else s.tokens
        if tokens:
            out.append(list(tokens))
    return out


@pytest.mark.parametrize("beam_size,clips", [(1, GREEDY_CLIPS), (5, BEAM_CLIPS)],
                         ids=["greedy", "beam5"])
def test_zeros_gives_openai_transcribe_tokens(tiny, oracle, audio, silence, beam_size, clips):
    model = oracle("tiny.en")
    zeros = _ours(tiny, [audio[c] for c in clips], beam_size=beam_size, mel_padding="zeros")
    for clip, ours in zip(clips, zeros, strict=True):
        ref = _theirs(model, audio[clip], beam_size, without_timestamps=True)
        assert _tokens(ours.segments) == _tokens(ref["segments"]), (clip, ours.text, ref["text"])
        assert ours.text == ref["text"].strip()
    differ = [c for c, z, s in zip(clips, zeros, silence(beam_size, clips), strict=True)
              if z.text != s.text]
    assert differ, "the layouts gave the same text on every clip: pick clips that tell them apart"


def test_cli_mel_padding_zeros(oracle, audio, capsys):
    from edserve.cli import main

    clip = "cards_005"  # silence: "Eight of spades, ..."; openai-whisper: "8 of spades, ..."
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", str(_path(clip)), "--mel-padding", "zeros", "--beam-size", "1",
              "--device", "cpu", "--output-format", "json"])
    assert exit_info.value.code == 0
    ours = json.loads(capsys.readouterr().out)
    ref = _theirs(oracle("tiny.en"), audio[clip], without_timestamps=True)
    assert ours["text"] == ref["text"].strip() and ours["text"].startswith("8 of spades")


def test_zeros_long_form_with_timestamps(tiny, oracle, audio):
    """Over 30 s: every window (the last one shorter than 30 s) laid out as openai-whisper's."""
    pause = np.zeros(8000, np.float32)
    long = np.concatenate([x for c in LONG_CLIPS for x in (audio[c], pause)])
    assert len(long) > 30 * 16000
    ours = _ours(tiny, [long], mel_padding="zeros")[0]
    ref = _theirs(oracle("tiny.en"), long)
    kept = [s for s in ref["segments"] if s["tokens"]]
    assert _tokens(ours.segments) == _tokens(kept)
    assert [(s.seek, s.start, s.end) for s in ours.segments] == \
        [(s["seek"], pytest.approx(s["start"]), pytest.approx(s["end"])) for s in kept]
    assert len({s.seek for s in ours.segments}) > 1  # more than one window


def test_zeros_word_timestamps_on_base(base, oracle, audio):
    model = oracle("base")
    results = _ours(base, [audio[c] for c in WORD_CLIPS], language="en", timestamps=True,
                    word_timestamps=True, mel_padding="zeros")
    for clip, ours in zip(WORD_CLIPS, results, strict=True):
        ref = _theirs(model, audio[clip], language="en", word_timestamps=True)
        assert _tokens(ours.segments) == _tokens(ref["segments"]), clip
        theirs = [w for s in ref["segments"] for w in s["words"]]
        assert [w.word for w in ours.words] == [w["word"] for w in theirs], clip
        for w, t in zip(ours.words, theirs, strict=True):
            assert abs(w.start - t["start"]) <= TIME_TOL and abs(w.end - t["end"]) <= TIME_TOL, \
                (clip, w, t)
            assert w.probability == pytest.approx(t["probability"], abs=1e-3)


def _detect(model, mel: torch.Tensor) -> tuple[str, float]:
    _, probs = model.detect_language(mel)
    code = max(probs, key=probs.get)
    return code, probs[code]


def test_language_detection_on_base(base, oracle, audio):
    """Detection sees the request's layout: zeros -> openai-whisper's ``detect_language`` on the
    zero-filled window; silence -> on the first 3000 frames of the padded log-mel, the window
    openai-whisper's ``transcribe()`` detects on (it then decodes the zero-filled one)."""
    from edserve.audio.mel import N_FRAMES, N_SAMPLES

    model = oracle("base")
    clips = list(LANGUAGE_CLIPS)
    # detection (and one token) on both clips in each layout
    zeros = _ours(base, [audio[c] for c in clips], mel_padding="zeros", max_new_tokens=1)
    silence = _ours(base, [audio[c] for c in clips], max_new_tokens=1)
    for clip, z, s in zip(clips, zeros, silence, strict=True):
        mel = whisper.log_mel_spectrogram(audio[clip], 80, padding=N_SAMPLES)
        content = mel.shape[-1] - N_FRAMES
        code, prob = _detect(model, whisper.pad_or_trim(mel[:, :content], N_FRAMES))
        assert z.language == code == LANGUAGE_CLIPS[clip]
        assert z.language_probability == pytest.approx(prob, abs=1e-4), clip
        code, prob = _detect(model, mel[:, :N_FRAMES])
        assert s.language == code and s.language_probability == pytest.approx(prob, abs=1e-4)
    ours = _ours(base, [audio[clips[0]]], mel_padding="zeros")[0]  # detect, then transcribe
    ref = _theirs(model, audio[clips[0]], without_timestamps=True)
    assert ref["language"] == ours.language == LANGUAGE_CLIPS[clips[0]]
    assert _tokens(ours.segments) == _tokens(ref["segments"]), (ours.text, ref["text"])


def test_silence_gives_openai_decode_tokens(oracle, audio, silence):
    """The default layout = openai-whisper's README example: ``decode()`` on the log-mel of the
    audio padded to 30 s."""
    model = oracle("tiny.en")
    clips = GREEDY_CLIPS
    ours = silence(1, clips)
    for clip, result in zip(clips, ours, strict=True):
        mel = whisper.log_mel_spectrogram(whisper.pad_or_trim(audio[clip]), 80)
        ref = whisper.decode(model, mel, whisper.DecodingOptions(
            language="en", without_timestamps=True, fp16=False))
        assert [t for s in result.segments for t in s.tokens] == ref.tokens, \
            (clip, result.text, ref.text)
