"""Log-mel features equal HF transformers' WhisperFeatureExtractor and openai-whisper's (bit for
bit); the two window layouts (``silence``, ``zeros``) of a window shorter than 30 s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank

from edserve.audio.decode import load_audio
from edserve.audio.mel import (
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    host_contiguous,
    log_mel_spectrogram,
    mel_filters,
    pad_or_trim,
    whisper_features,
    window_features,
)
from edserve.config import check_mel_padding

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    return load_audio(JFK)


def test_constants():
    assert (SAMPLE_RATE, N_FFT, HOP_LENGTH, N_SAMPLES, N_FRAMES) == (16000, 400, 160, 480000, 3000)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_slaney_filterbank(n_mels):
    expected = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=n_mels, min_frequency=0.0,
        max_frequency=SAMPLE_RATE / 2, sampling_rate=SAMPLE_RATE, norm="slaney",
        mel_scale="slaney",
    ).T  # [n_mels, 201]
    filters = mel_filters(n_mels)
    assert filters.shape == (n_mels, 201) and filters.dtype == torch.float32
    np.testing.assert_allclose(filters.numpy(), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_match_hf_feature_extractor(jfk, n_mels):
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    expected = extractor(jfk, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    features = whisper_features(jfk, n_mels)
    assert features.shape == (n_mels, N_FRAMES) and features.dtype == torch.float32
    np.testing.assert_allclose(features.numpy(), expected, rtol=0, atol=1e-4)


def test_features_equal_openai_transcribe_padding(jfk):
    # openai-whisper's transcribe appends N_SAMPLES zeros, then takes the first 3000 frames.
    padded = log_mel_spectrogram(jfk, 80, padding=N_SAMPLES)
    assert padded.shape == (80, (len(jfk) + N_SAMPLES) // HOP_LENGTH)
    torch.testing.assert_close(whisper_features(torch.from_numpy(jfk), 80), padded[:, :N_FRAMES])


def test_long_audio_is_cut_to_one_window(jfk):
    long = np.tile(jfk, 4)  # 44 s
    torch.testing.assert_close(whisper_features(long, 80), whisper_features(long[:N_SAMPLES], 80))


def test_pad_or_trim_numpy_and_torch():
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(pad_or_trim(x, 4), x[:4])
    np.testing.assert_array_equal(pad_or_trim(x, 12), np.r_[x, 0, 0])
    assert pad_or_trim(x, 10) is x
    t = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(pad_or_trim(t, 2), t[:, :2])
    torch.testing.assert_close(pad_or_trim(t, 4), torch.tensor([[0.0, 1, 2, 0], [3, 4, 5, 0]]))
    torch.testing.assert_close(pad_or_trim(t, 3, axis=0), torch.cat([t, torch.zeros(1, 3)]))


def test_log_mel_rejects_non_1d():
    with pytest.raises(ValueError, match="1-D"):
        log_mel_spectrogram(np.zeros((2, 100), np.float32))


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filters_and_log_mel_equal_openai_whisper_bit_for_bit(jfk, n_mels):
    import whisper  # the official package (test extra)

    assert torch.equal(mel_filters(n_mels), whisper.audio.mel_filters("cpu", n_mels))
    assert torch.equal(log_mel_spectrogram(jfk, n_mels, padding=N_SAMPLES),
                       whisper.log_mel_spectrogram(jfk, n_mels, padding=N_SAMPLES))


def test_padding_frames_skipped_by_the_stft_change_no_bit(jfk):
    """The STFT runs over the audio + a short zero tail; frames wholly in the padding are
    filled in. Bit-equal to openai-whisper's STFT over all the padding, at lengths around the
    frame and tail boundaries (speech and noise), for every padding size."""
    import whisper

    rng = np.random.default_rng(0)
    lengths = [201, 399, 801, 1600, 10_239, 10_240, 10_241, 20_481, 47_999] + \
        [int(n) for n in rng.integers(300, len(jfk), 6)] + [len(jfk)]
    for n in lengths:
        for audio in (jfk[:n], (rng.standard_normal(n) * 0.1).astype(np.float32)):
            for padding in (0, 801, 30_000, N_SAMPLES):
                want = whisper.log_mel_spectrogram(audio, 80, padding=padding)
                assert torch.equal(log_mel_spectrogram(audio, 80, padding=padding), want), \
                    (n, padding)


def test_window_layouts_of_a_short_clip(jfk):
    mel = log_mel_spectrogram(jfk, 80, padding=N_SAMPLES)  # [80, 1100 + 3000]
    size = mel.shape[-1] - N_FRAMES
    silence = window_features(mel, 0, size, "silence")
    zeros = window_features(mel, 0, size, "zeros")
    assert silence.shape == zeros.shape == (80, N_FRAMES)
    # silence: the log-mel of the clip padded to 30 s (HF's extractor, openai's decode example)
    assert torch.equal(silence, whisper_features(jfk, 80))
    # zeros: openai-whisper's transcribe: the clip's frames, then 0.0
    assert torch.equal(zeros[:, :size], mel[:, :size]) and not zeros[:, size:].any()
    floor = silence[:, size + 2:]  # past the frames whose STFT window still reaches the clip
    assert (floor == floor.min()).all() and floor.min() < -0.5  # the log-mel floor, not 0.0


def test_window_layouts_agree_on_a_full_window(jfk):
    mel = log_mel_spectrogram(np.tile(jfk, 4), 80, padding=N_SAMPLES)  # 44 s
    for seek in (0, 1000):
        assert torch.equal(window_features(mel, seek, N_FRAMES, "silence"),
                           window_features(mel, seek, N_FRAMES, "zeros"))
    last = mel.shape[-1] - N_FRAMES - 4000  # the 14 s left after a window at 4000
    tail = window_features(mel, 4000, last, "zeros")
    assert torch.equal(tail[:, :last], mel[:, 4000:4000 + last]) and not tail[:, last:].any()
    with pytest.raises(ValueError, match="does not fit"):
        window_features(mel, mel.shape[-1] - 10, 10, "zeros")


def test_mel_padding_names_are_checked_once():
    assert check_mel_padding("zeros") == "zeros"
    for bad in ("Zeros", "", None, 0, "x" * 100):
        with pytest.raises(ValueError, match="'mel_padding' must be one of silence, zeros"):
            check_mel_padding(bad)


def test_host_contiguous_copies_a_window_exactly():
    mel = torch.randn(80, 4100)
    window = mel[:, 1100:4100]  # a non-contiguous slice, as a request's window
    out = host_contiguous(window)
    assert out.is_contiguous() and torch.equal(out, window)
    out[0, 0] = 7.0
    assert mel[0, 1100] != 7.0  # a copy, not a view
    whole = torch.randn(80, 3000)
    assert host_contiguous(whole) is whole
