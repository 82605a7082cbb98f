"""A prefill step's log-mels from PCM windows (edserve.models.step_mel) equal the host's
long-form log-mel windows, whatever the clip length, window start, layout, sample type and
device; the model takes PCM windows beside log-mels and refuses bad ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from edserve.audio.decode import load_audio
from edserve.audio.mel import N_FRAMES, mel_filters, window_features
from edserve.audio.pcm_window import MAX_STEP_SAMPLES, PcmMel, PcmWindow, fits_step
from edserve.audio.prepare import longform_compact_mel
from edserve.models.mel_staging import MelStager
from edserve.models.step_mel import stage_pcm, window_log_mels
from edserve.models.whisper_inputs import WhisperInputs

JFK = Path(__file__).resolve().parents[1] / "data" / "jfk.wav"


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    return load_audio(JFK)  # [176000] float32


def _clip(jfk: np.ndarray, n: int, pcm16: bool) -> np.ndarray:
    x = np.resize(jfk, n)
    return np.round(x * 32767).astype(np.int16) if pcm16 else x


def _host_window(samples: np.ndarray, n_mels: int, seek: int, padding: str) -> torch.Tensor:
    x = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    mel = longform_compact_mel(x, n_mels)
    size = min(N_FRAMES, mel.shape[1] - N_FRAMES - seek)
    w = window_features(mel, seek, size, padding)
    return w.full() if hasattr(w, "full") else w


CASES = [  # (samples, seek, padding, int16)
    (160, 0, "silence", False), (176000, 0, "silence", True), (176000, 0, "zeros", False),
    (176000, 700, "silence", False), (176000, 700, "zeros", True),
    (MAX_STEP_SAMPLES, 0, "silence", False), (MAX_STEP_SAMPLES, 2990, "zeros", True),
    (12345, 3, "silence", True),
]


def test_batched_window_log_mels_equal_the_host_windows(jfk):
    clips = [_clip(jfk, n, pcm16) for n, _, _, pcm16 in CASES]
    windows = [PcmMel(c, 80).window(seek, min(N_FRAMES, len(c) // 160 - seek),
                                    zero_filled=padding == "zeros")
               for c, (_, seek, padding, _) in zip(clips, CASES, strict=True)]
    got = window_log_mels(windows, mel_filters(80))  # one batch, every case at once
    assert got.shape == (len(CASES), 80, N_FRAMES) and got.dtype == torch.float32
    for row, c, (n, seek, padding, _) in zip(got, clips, CASES, strict=True):
        want = _host_window(c, 80, seek, padding)
        torch.testing.assert_close(row, want, rtol=0, atol=2e-5, msg=f"{n} {seek} {padding}")
    # the window_features path gives the same PcmWindow the test built
    w = window_features(PcmMel(clips[1], 80), 0, 1100, "zeros")
    assert isinstance(w, PcmWindow) and w.zeros_from == 1100 and w.seek == 0


def test_staged_samples_are_float_and_equal(jfk):
    pcm = _clip(jfk, 16000, pcm16=True)
    staged = stage_pcm(PcmWindow(pcm, 80), None)
    assert staged.samples.dtype == torch.float32
    assert torch.equal(staged.samples, torch.from_numpy(pcm.astype(np.float32) / 32768))
    full = MelStager(max_bytes=0)  # no room: the samples stay pageable (the step pins them)
    assert not torch.is_tensor(staged.samples) or not full.is_staged(staged.samples)
    unpinned = stage_pcm(PcmWindow(pcm, 80), full)
    assert torch.equal(unpinned.samples, staged.samples) and full.staged_bytes == 0
    one = window_log_mels([staged], mel_filters(80))
    torch.testing.assert_close(one[0], _host_window(pcm, 80, 0, "silence"), rtol=0, atol=2e-5)


def test_int16_tensor_samples_are_scaled_in_the_step_as_the_host_does(jfk):
    """A CUDA stager keeps 16-bit samples int16 (page-locked); the step scales them where they
    land. The same path on the CPU: int16 and float32 tensors mixed in one batch give exactly
    the log-mels of the host-converted samples."""
    clips = [_clip(jfk, n, pcm16=True) for n in (176000, 9000)]
    as16 = [dataclasses.replace(PcmWindow(c, 80), samples=torch.from_numpy(c)) for c in clips]
    as32 = [stage_pcm(PcmWindow(c, 80), None) for c in clips]
    assert as32[0].samples.dtype == torch.float32
    mixed = window_log_mels([as16[0], as32[1]], mel_filters(80))
    want = window_log_mels(as32, mel_filters(80))
    assert torch.equal(mixed, want)
    assert torch.equal(window_log_mels(as16, mel_filters(80)), want)


def test_pcm_mel_shape_and_bad_windows_are_refused(jfk):
    mel = PcmMel(_clip(jfk, 176000, False), 128)
    assert mel.shape == (128, 1100 + N_FRAMES) == longform_compact_mel(jfk, 128).shape
    assert fits_step(MAX_STEP_SAMPLES) and not fits_step(MAX_STEP_SAMPLES + 1)
    assert not fits_step(0)
    with pytest.raises(ValueError, match="does not fit"):
        PcmMel(np.zeros(MAX_STEP_SAMPLES + 1, np.float32), 80)
    with pytest.raises(ValueError, match="int16 or float32"):
        PcmMel(np.zeros(100, np.float64), 80)
    with pytest.raises(ValueError, match="window of"):
        mel.window(1000, 200, zero_filled=False)  # past the clip's 1100 frames
    with pytest.raises(ValueError, match="bad PCM window"):
        PcmWindow(np.zeros(100, np.float32), 80, seek=N_FRAMES)


def test_the_model_inputs_check_pcm_windows_and_mix_them_with_log_mels(jfk):
    inputs = WhisperInputs(80, N_FRAMES)
    bad = np.array(jfk[:1000])
    bad[5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        inputs.check(PcmWindow(bad, 80))
    with pytest.raises(ValueError, match="128 mel bins"):
        inputs.check(PcmWindow(jfk[:1000], 128))
    with pytest.raises(ValueError, match="PcmWindow"):
        inputs.check(np.zeros((80, N_FRAMES)))
    pcm = PcmWindow(jfk, 80)
    inputs.check(pcm)
    mel = _host_window(jfk, 80, 0, "zeros")
    staged = [inputs.stage(x, torch.device("cpu")) for x in (mel, pcm, mel)]
    batch = inputs.to_device(staged, torch.device("cpu"))  # [3, 80, 3000], in order
    assert batch.shape == (3, 80, N_FRAMES)
    assert torch.equal(batch[0], mel) and torch.equal(batch[2], mel)
    torch.testing.assert_close(batch[1], _host_window(jfk, 80, 0, "silence"), rtol=0, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_without_syncs_within_fp32_tolerance(jfk):
    inputs = WhisperInputs(128, N_FRAMES)
    dev = torch.device("cuda")
    inputs.filters(dev)
    clips = [PcmMel(_clip(jfk, n, True), 128).window(s, min(N_FRAMES, n // 160 - s), z)
             for n, s, z in [(176000, 0, False), (300000, 40, True), (8000, 0, True)]]
    staged = [inputs.stage(c, dev) for c in clips]
    assert all(s.samples.is_pinned() and inputs.stager.is_staged(s.samples) for s in staged)
    assert all(s.samples.dtype == torch.int16 for s in staged)  # scaled on the device
    assert inputs.stager.staged_bytes == 2 * sum(c.num_samples for c in clips)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = inputs.to_device(staged, dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for row, c in zip(got.cpu(), clips, strict=True):
        samples = c.samples
        want = _host_window(samples, 128, c.seek, "zeros" if c.zeros_from < N_FRAMES
                            else "silence")
        torch.testing.assert_close(row, want, rtol=0, atol=2e-4)  # cuFFT vs pocketfft
