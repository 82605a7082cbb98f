"""The chunked long-form log-mel (host and device paths) against the one-STFT reference
(itself bit-equal to openai-whisper's, tests/audio/test_mel.py), and the deferred features of
a long upload."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from edserve.audio.chunked_mel import chunked_log_mel
from edserve.audio.compact_mel import CompactMel
from edserve.audio.decode import load_audio
from edserve.audio.device_mel import device_features
from edserve.audio.errors import AudioTooLongError, NonFiniteAudioError
from edserve.audio.mel import N_SAMPLES, log_mel_spectrogram
from edserve.audio.prepare import (
    DecodedAudio,
    PreparedAudio,
    decode_long_wav,
    longform_mel,
    prepare_upload,
)

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


def _wav(samples: np.ndarray, float_pcm: bool = False) -> bytes:
    """Mono 16 kHz WAV: 16-bit PCM, or 32-bit float (which can carry NaN)."""
    if float_pcm:
        data, fmt = samples.astype("<f4").tobytes(), struct.pack("<HHIIHH", 3, 1, 16000,
                                                                    64000, 4, 32)
    else:
        data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
        fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" \
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) \
        + data


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    return load_audio(JFK)


def _assembled(head: torch.Tensor, fill: torch.Tensor, frames: int) -> torch.Tensor:
    return CompactMel(head.numpy(), np.float32(fill.item()), frames).full()


@pytest.mark.parametrize("chunk_frames", [64, 1024, 1 << 16])
@pytest.mark.parametrize("seconds", [0.0625, 11.0, 47.3])
def test_chunks_give_the_one_stft_values(jfk, chunk_frames, seconds):
    n = int(seconds * 16000)
    audio = torch.from_numpy(np.resize(jfk, n))  # jfk repeated to n samples
    want = log_mel_spectrogram(audio, 80, padding=N_SAMPLES)
    head, fill, frames = chunked_log_mel(audio, 80, chunk_frames=chunk_frames)
    assert frames == want.shape[1] and head.shape[0] == 80 and head.shape[1] <= frames
    got = _assembled(head, fill, frames)
    # the same numbers (equal bits on the CPUs we ran; the contract is fp32 tolerance)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert fill.item() == pytest.approx(want[0, -1].item())


def test_longform_mel_and_a_128_bin_model(jfk):
    want = log_mel_spectrogram(jfk, 128, padding=N_SAMPLES)
    torch.testing.assert_close(longform_mel(jfk, 128), want, rtol=0, atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1-D"):
        chunked_log_mel(torch.zeros(2, 100), 80)
    with pytest.raises(ValueError, match="multiple of 64"):
        chunked_log_mel(torch.zeros(1000), 80, chunk_frames=100)


def test_device_features_on_the_cpu_equal_the_host_path(jfk):
    prepared = device_features(DecodedAudio(jfk, 0.25), 80, "cpu", chunk_frames=256)
    assert isinstance(prepared, PreparedAudio) and isinstance(prepared.mel, CompactMel)
    assert prepared.num_samples == len(jfk) and prepared.decode_s == 0.25
    assert prepared.features_s > 0
    torch.testing.assert_close(prepared.mel.full(), longform_mel(jfk, 80), rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_features_on_cuda_match_the_cpu_within_fp32_tolerance(jfk):
    long = np.resize(jfk, 16000 * 700)  # > one device chunk (65,536 frames)
    stream = torch.cuda.Stream()
    prepared = device_features(DecodedAudio(long), 128, "cuda", stream)
    want = longform_mel(long, 128)
    # cuFFT and cuBLAS round differently: log10 power in [-2, 2] after scaling
    torch.testing.assert_close(prepared.mel.full(), want, rtol=0, atol=2e-4)


def test_a_long_upload_is_deferred_a_short_one_is_not(jfk):
    data = _wav(jfk)
    short = prepare_upload(data, 80, 60.0, defer_above_s=20.0)
    assert isinstance(short, PreparedAudio)
    deferred = prepare_upload(data, 80, 60.0, defer_above_s=5.0)
    assert isinstance(deferred, DecodedAudio) and deferred.decode_s > 0
    np.testing.assert_array_equal(deferred.samples, short_samples := load_audio(data))
    assert deferred.num_samples == len(short_samples) == short.num_samples
    bad = jfk.copy()
    bad[1000] = np.nan
    with pytest.raises(NonFiniteAudioError):  # checked before it leaves the worker
        prepare_upload(_wav(bad, float_pcm=True), 80, 60.0, defer_above_s=5.0)


def test_a_long_16_khz_wav_is_decoded_in_place_anything_else_is_left_to_the_workers(jfk):
    long = np.resize(jfk, 16000 * 40)
    data = _wav(long)
    got = decode_long_wav(data, 60.0, 30.0)
    assert isinstance(got, DecodedAudio) and got.decode_s >= 0
    assert got.samples.dtype == np.int16  # half the bytes to the engine process
    np.testing.assert_array_equal(got.float_samples(), load_audio(data))  # FFmpeg's, exactly
    # the device converts them as the host does: the same log-mel, bit for bit
    as_int16 = device_features(got, 80, "cpu", chunk_frames=256).mel.full()
    as_float = device_features(DecodedAudio(got.float_samples()), 80, "cpu",
                               chunk_frames=256).mel.full()
    assert torch.equal(as_int16, as_float)
    assert decode_long_wav(data, 60.0, 45.0) is None  # not longer than the threshold
    assert decode_long_wav(_wav(jfk), 60.0, 5.0) is not None
    assert decode_long_wav(_wav(long, float_pcm=True), 60.0, 30.0) is None  # float: FFmpeg's
    assert decode_long_wav(b"not a wav" * 200000, 60.0, 30.0) is None
    with pytest.raises(AudioTooLongError):
        decode_long_wav(data, 20.0, 5.0)
