"""CompactMel: a log-mel without its constant tail slices exactly like the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edserve.audio.compact_mel import CompactMel, split_tail
from edserve.audio.decode import load_audio
from edserve.audio.mel import MEL_PADDINGS, N_FRAMES, window_features
from edserve.audio.prepare import longform_mel
from tests.audio.test_decode import JFK


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


@pytest.fixture(scope="module")
def whole():
    return longform_mel(load_audio(JFK), 80)  # [80, 1100 + 3000]


def test_slices_equal_the_tensor_bit_for_bit(whole):
    compact = CompactMel.of(whole.numpy())
    assert compact.head.shape[1] < whole.shape[1] // 2 and compact.shape == tuple(whole.shape)
    t = compact.head.shape[1]
    for a, b in [(0, 10), (0, whole.shape[1]), (t - 5, t + 5), (t, t + 7), (t + 3, t + 3),
                 (100, 100 + N_FRAMES), (whole.shape[1] - 1, whole.shape[1]), (5, None)]:
        got = compact[:, a:b]
        assert got.is_contiguous() and np.array_equal(_bits(got), _bits(whole[:, a:b])), (a, b)


@pytest.mark.parametrize("padding", MEL_PADDINGS)
def test_windows_equal_the_tensor_windows(whole, padding):
    compact = CompactMel.of(whole.numpy())
    content = whole.shape[1] - N_FRAMES
    for seek, size in [(0, content), (0, 500), (700, content - 700), (content - 1, 1)]:
        want = window_features(whole, seek, size, padding)
        got = window_features(compact, seek, size, padding)
        # the silence window stays compact (written out where the request is staged)
        assert isinstance(got, CompactMel) == (padding == "silence")
        got = got.full() if isinstance(got, CompactMel) else got
        assert got.shape == (80, N_FRAMES) and np.array_equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="does not fit"):
        window_features(compact, content + 1, 10, padding)


def test_exact_cut_and_bad_indexing():
    m = np.zeros((2, 5), np.float32)
    m[0, 3] = -0.0  # not the bits of +0.0: kept in the head
    head, fill = split_tail(m)
    assert head.shape == (2, 4) and fill == 0.0
    m.view(np.uint32)[:, -1] = 0x7FC00123  # a NaN with a payload survives
    assert np.array_equal(CompactMel.of(m).full().numpy().view(np.uint32), m.view(np.uint32))
    r = np.arange(10, dtype=np.float32).reshape(2, 5)  # no constant last column: nothing cut
    assert split_tail(r)[0].shape == (2, 5)
    with pytest.raises(IndexError):
        CompactMel.of(r)[0, 1:3]
    with pytest.raises(IndexError):
        CompactMel.of(r)[:, ::2]


def test_a_window_is_compact_and_exact(whole):
    compact = CompactMel.of(whole.numpy())
    t, frames = compact.head.shape[1], whole.shape[1]
    for a, b in [(0, N_FRAMES), (t - 5, t - 5 + N_FRAMES), (t + 2, frames),
                 (frames - N_FRAMES, frames), (0, t), (4, 4)]:
        w = compact.window(a, b)
        assert w.shape == (80, b - a) and w.head.shape[1] <= max(0, min(b, t) - a)
        assert np.shares_memory(w.head, compact.head) or w.head.size == 0  # no copy made
        out = w.write_to(np.full((80, b - a), np.nan, np.float32))  # every entry written
        assert np.array_equal(out.view(np.uint32), _bits(whole[:, a:b])), (a, b)
        assert np.array_equal(_bits(w.full()), _bits(whole[:, a:b]))
    for a, b in [(-1, 10), (5, 4), (0, frames + 1)]:
        with pytest.raises(IndexError):
            compact.window(a, b)


def test_all_finite_reads_the_head_and_the_fill(whole):
    compact = CompactMel.of(whole.numpy())
    assert compact.all_finite() and compact.window(0, N_FRAMES).all_finite()
    head = compact.head.copy()
    head[3, 7] = np.nan
    assert not CompactMel(head, compact.fill, compact.frames).all_finite()
    assert not CompactMel(compact.head, np.float32(np.inf), compact.frames).all_finite()
