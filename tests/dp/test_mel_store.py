"""edserve.dp.mel_store.MelStore and held log-mels' windows: a window written out by the store
equals the same window of the log-mel itself (both layouts, windows inside the audio, across
its end and in the silence), the byte budget, release, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dp.reference import DATA
from edserve.audio.compact_mel import CompactMel
from edserve.audio.decode import load_audio
from edserve.audio.held_mel import HeldMel, MelWindowRef
from edserve.audio.mel import N_FRAMES, window_features
from edserve.audio.prepare import longform_compact_mel
from edserve.dp.mel_store import MelStore


@pytest.fixture(scope="module")
def compact() -> CompactMel:
    audio = load_audio(DATA / "jfk.wav")  # 11 s: 1100 frames of audio + 3000 of silence
    return longform_compact_mel(np.concatenate([audio] * 4), 80)  # 44 s: two windows


def _hold(store: MelStore, c: CompactMel) -> HeldMel:
    held = store.hold(torch.from_numpy(c.head.copy()), float(c.fill), c.frames)
    assert held is not None and held.shape == c.shape
    return held


@pytest.mark.parametrize("padding", ["silence", "zeros"])
def test_windows_equal_the_log_mels_own(compact, padding):
    store = MelStore()
    held = _hold(store, compact)
    full = compact.full()
    content = compact.frames - N_FRAMES
    t = compact.head.shape[1]
    seeks = [0, 1234, content - N_FRAMES, content - 17, min(t, content) - 5, content - 1]
    for seek in seeks:
        size = min(N_FRAMES, content - seek)
        ref = window_features(held, seek, size, padding)
        assert isinstance(ref, MelWindowRef) and ref.shape == (80, N_FRAMES)
        got = store.window(ref)
        want = window_features(full, seek, size, padding)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), (seek, size)
        compact_window = window_features(compact, seek, size, padding)
        compact_window = compact_window.full() if isinstance(compact_window, CompactMel) \
            else compact_window
        assert torch.equal(got, compact_window)
    assert torch.equal(store.window(held[:, 5:40]), full[:, 5:40])  # plain slicing too


def test_budget_release_and_errors(compact):
    nbytes = compact.head.size * 4
    store = MelStore(max_bytes=int(nbytes * 1.5))
    held = _hold(store, compact)
    assert store.held_bytes == nbytes and len(store) == 1
    assert store.hold(torch.from_numpy(compact.head), 0.0, compact.frames) is None  # full
    with pytest.raises(ValueError, match="does not fit"):
        store.window(MelWindowRef(held.mel_id, 80, compact.frames - 10, compact.frames + 1,
                                  N_FRAMES))
    with pytest.raises(ValueError, match="does not fit"):
        store.window(MelWindowRef(held.mel_id, 128, 0, 10, 10))
    with pytest.raises(ValueError, match="float32"):
        store.hold(torch.zeros(80, 10, dtype=torch.float64), 0.0, 10)
    assert store.release(held.mel_id) and not store.release(held.mel_id)
    assert store.held_bytes == 0 and len(store) == 0
    with pytest.raises(ValueError, match="not held"):
        store.window(held.window(0, 10))
    second = _hold(store, compact)  # the budget is back
    assert second.mel_id != held.mel_id


def test_refs_check_their_bounds():
    held = HeldMel(3, 80, 5000)
    with pytest.raises(IndexError):
        held.window(4000, 5001)
    with pytest.raises(IndexError):
        held[:, ::2]
    with pytest.raises(ValueError, match="bad log-mel window"):
        MelWindowRef(3, 80, 10, 3100, N_FRAMES)
    assert held.window(4990, 5000, N_FRAMES).shape == (80, N_FRAMES)
    held.release()  # no hook: nothing to do


def test_budget_from_the_environment(monkeypatch):
    from edserve.dp.mel_store import BUDGET_ENV, DEFAULT_MAX_BYTES, budget_from_env

    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert budget_from_env() == DEFAULT_MAX_BYTES
    monkeypatch.setenv(BUDGET_ENV, "0")
    assert budget_from_env() == 0
    assert MelStore(0).hold(torch.zeros(80, 10), 0.0, 10) is None  # 0: values, not held
    monkeypatch.setenv(BUDGET_ENV, "-5")
    with pytest.raises(ValueError, match=BUDGET_ENV):
        budget_from_env()
