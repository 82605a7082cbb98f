"""Word-timing pieces (openai-whisper's method): DTW against a plain float64 loop, median
filter, word splitting that concatenates back to the text, punctuation merging, and a
synthetic alignment whose word times are known."""

from __future__ import annotations

import numpy as np
import pytest

from edserve.whisper.alignment import (
    WordTiming,
    alignment_heads,
    dtw,
    median_filter,
    merge_punctuations,
    split_words,
    word_timings,
)


def _dtw_reference(x: np.ndarray) -> tuple[list[int], list[int]]:
    """Textbook DTW, float64, cell by cell (openai-whisper's tie rules)."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    cost[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=int)
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            t = 0 if c0 < c1 and c0 < c2 else 1 if c1 < c0 and c1 < c2 else 2
            cost[i, j] = x[i - 1, j - 1] + (c0, c1, c2)[t]
            trace[i, j] = t
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = 2 if i == 0 else 1 if j == 0 else trace[i, j]
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    path.reverse()
    return [p[0] for p in path], [p[1] for p in path]


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (7, 1), (5, 40), (23, 150)])
def test_dtw_matches_a_plain_loop(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    text, time = dtw(x)
    ref_text, ref_time = _dtw_reference(x)
    assert text.tolist() == ref_text and time.tolist() == ref_time
    assert text[0] == 0 and time[0] == 0 and text[-1] == shape[0] - 1


def test_median_filter():
    x = np.array([[1.0, 9.0, 2.0, 3.0, 8.0, 4.0, 5.0, 0.0]])
    out = median_filter(x, 3)
    padded = np.pad(x[0], 1, mode="reflect")
    assert out[0].tolist() == [float(np.median(padded[i:i + 3])) for i in range(8)]
    assert median_filter(x[:, :1], 7) is not None


def test_words_concatenate_to_the_text(tok):
    text = " And so, my fellow Americans: ask not (what) your country's \"can\" do!"
    ids = tok.encode(text)
    words, groups = split_words(tok, ids, "en")
    assert "".join(words) == text and [t for g in groups for t in g] == ids
    assert words[:3] == [" And", " so", ","]
    chars, _ = split_words(tok, tok.encode("你好世界"), "zh")
    assert chars == ["你", "好", "世", "界"]


def test_punctuation_merges_into_neighbours():
    words = [WordTiming(w) for w in [" (", "what", ")", " is", " it", "?", " \"", "Yes"]]
    merged = [w.word for w in merge_punctuations(words)]
    assert merged == [" (what)", " is", " it?", " \"Yes"]


def test_synthetic_alignment_gives_the_planted_times(tok):
    """Each text token attends to its own 0.4 s stretch of audio: the DTW path must put each
    word at its stretch (within one 20 ms frame)."""
    text = " ask not what your country"
    ids = tok.encode(text)
    sot_len, frames = 2, 3000
    rows = sot_len + len(ids) + 1
    weights = np.full((2, rows, 1500), 1e-3)
    for k in range(len(ids) + 1):  # query row sot_len - 1 + k predicts token k
        weights[:, sot_len - 1 + k, 20 * k:20 * (k + 1)] = 1.0
    weights /= weights.sum(axis=-1, keepdims=True)
    words = word_timings(weights, tok, ids, sot_len, frames, "en")
    assert "".join(w.word for w in words) == text
    for k, w in enumerate(words):  # one token per word here
        assert abs(w.start - 0.4 * k) <= 0.02 and abs(w.end - 0.4 * (k + 1)) <= 0.02


def test_alignment_heads_default_to_the_second_half():
    assert alignment_heads({"alignment_heads": [[3, 1], [5, 4]]}, 6, 8) == [(3, 1), (5, 4)]
    assert alignment_heads({}, 4, 2) == [(2, 0), (2, 1), (3, 0), (3, 1)]
