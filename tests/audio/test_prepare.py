"""``prepare_upload``: an upload's long-form log-mel, the same numbers a LongformTask computes
from the samples, and every refusal of ``load_audio`` (pickled across processes intact)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from edserve.audio.compact_mel import CompactMel
from edserve.audio.decode import load_audio
from edserve.audio.errors import AudioDecodeError, AudioTooLongError, NonFiniteAudioError
from edserve.audio.mel import N_FRAMES, log_mel_spectrogram
from edserve.audio.prepare import PreparedAudio, prepare_samples, prepare_upload

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


def test_upload_features_equal_longform_mel_of_the_samples():
    data = JFK.read_bytes()
    prepared = prepare_upload(data, 80, 60.0)
    audio = load_audio(data, untrusted=True)
    assert prepared.num_samples == len(audio)
    # openai-whisper's transcribe(): one log-mel of the audio + 30 s of zeros
    want = log_mel_spectrogram(audio, 80, padding=480000)
    assert prepared.mel.shape == (80, len(audio) // 160 + N_FRAMES)
    assert isinstance(prepared.mel, CompactMel)  # computed without its constant tail
    assert torch.equal(prepared.mel.full(), want)
    assert prepared.decode_s > 0 and prepared.features_s > 0


def test_prepared_audio_pickles_as_numpy_and_back():
    prepared = prepare_samples(np.linspace(-0.5, 0.5, 16000, dtype=np.float32), 80)
    back = pickle.loads(pickle.dumps(prepared, protocol=5))
    assert isinstance(back, PreparedAudio) and back.num_samples == 16000
    assert torch.equal(back.mel.full(), prepared.mel.full()) and back.n_mels == 80


def test_refusals_survive_pickling():
    for exc, data, limit in ((AudioDecodeError, b"RIFF" + bytes(500), None),
                             (AudioTooLongError, JFK.read_bytes(), 2.0)):
        with pytest.raises(exc) as info:
            prepare_upload(data, 80, limit)
        again = pickle.loads(pickle.dumps(info.value))
        assert type(again) is exc and str(again) == str(info.value)
    with pytest.raises(NonFiniteAudioError):
        prepare_samples(np.array([0.0, np.nan], np.float32), 80)


def test_the_silence_tail_travels_as_one_value_and_comes_back_bit_exact():
    jfk = load_audio(Path(__file__).resolve().parents[1] / "data" / "jfk.wav")
    prepared = prepare_samples(jfk, 128)
    want = log_mel_spectrogram(jfk, 128, padding=480000)
    blob = pickle.dumps(prepared, protocol=5)
    assert len(blob) < 0.4 * want.numel() * 4  # 11 s of audio + 30 s of silence
    back = pickle.loads(blob)
    assert isinstance(back.mel, CompactMel) and back.mel.shape == tuple(want.shape)
    full = back.mel.full()
    assert full.dtype == torch.float32 and full.is_contiguous()
    assert torch.equal(full.view(torch.int32), want.view(torch.int32))
    again = pickle.loads(pickle.dumps(back, protocol=5))  # a compact one pickles as is
    assert torch.equal(again.mel.full(), full)
