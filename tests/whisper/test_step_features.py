"""Transcriptions whose log-mels the engine computes in its prefill step (PCM windows) give
the tokens of the host log-mel path: tiny.en's real weights on the bundled clips, both window
layouts, with and without timestamps, 16-bit and float samples; a window that starts inside
a clip (after an unfinished segment) and a batch that mixes both kinds of input too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edserve.audio.decode import load_audio
from edserve.audio.mel import N_FRAMES
from edserve.audio.pcm_window import PcmWindow
from edserve.audio.prepare import DecodedAudio, step_features
from edserve.audio.wav_pcm import read_pcm_wav
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, run_tasks

DATA = Path(__file__).resolve().parents[1] / "data"
CLIPS = ["alsa_Front_Left", "cards_005", "jfk", "librivox_0870", "librivox_0880"]


@pytest.fixture(scope="module")
def tiny():
    return build_engine(device="cpu", max_running_requests=16)


def _pcm16(name: str) -> np.ndarray:
    with open(DATA / f"{name}.wav", "rb") as f:
        return read_pcm_wav(f, 16000, None, 1.0, pcm16=True)  # int16 as the WAV holds them


def _run(engine, audios, options):
    tasks = [make_task(engine, a, options) for a in audios]
    run_tasks(engine, tasks)
    return [[s.tokens for s in t.result().segments] for t in tasks], tasks


@pytest.mark.parametrize("padding", ["silence", "zeros"])
@pytest.mark.parametrize("timestamps", [False, True])
def test_step_log_mels_give_the_host_tokens(tiny, padding, timestamps):
    opts = TranscribeOptions(temperatures=(0.0,), mel_padding=padding, timestamps=timestamps)
    host = [load_audio(DATA / f"{c}.wav") for c in CLIPS]
    want, _ = _run(tiny, host, opts)
    n_mels = tiny.model.config.num_mel_bins
    steps = [step_features(DecodedAudio(_pcm16(c)), n_mels) for c in CLIPS[:3]] \
        + [step_features(DecodedAudio(a), n_mels) for a in host[3:]]  # int16 and float32
    mixed = [steps[0], host[1], steps[2], host[3], steps[4]]  # one batch of both kinds
    for audios in (steps, mixed):
        got, tasks = _run(tiny, audios, opts)
        assert got == want
        assert all(t.result().text for t in tasks)


def test_a_window_inside_the_clip_is_a_shifted_pcm_window(tiny):
    """After an unfinished segment the next window starts inside the clip: still a PCM
    window (shifted), decoded to the same tokens as the host log-mel's window."""
    audio = load_audio(DATA / "jfk.wav")
    opts = TranscribeOptions(temperatures=(0.0,), timestamps=True)
    prepared = step_features(DecodedAudio(audio), tiny.model.config.num_mel_bins)
    results = []
    for a in (audio, prepared):
        task = make_task(tiny, a, opts)
        task.next_request()
        task.seek = 412  # as if the first window had ended on an unfinished segment
        req = task.next_request()
        assert isinstance(req.encoder_input, PcmWindow) == (a is prepared)
        if a is prepared:
            assert req.encoder_input.seek == 412 and req.encoder_input.zeros_from == N_FRAMES
        out = tiny.generate([req])[0]
        results.append(out.token_ids)
    assert results[0] == results[1] and len(results[0]) > 3
