"""Word timings from cross-attention weights (openai-whisper's method, ``timing.py``).

Input: the softmaxed cross-attention weights of the model's alignment heads for one window's
decoder sequence ``[sot sequence..., text tokens..., eot]`` over the window's audio frames.
Per head the weights are standardised over the tokens, median-filtered over time (width 7)
and averaged over heads; dynamic time warping over ``-weights`` (text tokens x 20 ms frames)
gives a monotonic path; a word starts where the path first enters its first token. Words are
split on spaces (per character for languages written without them), punctuation is merged
into its neighbour word, and long words next to sentence ends are clipped.

Everything here is host-side numpy on one window (``[heads, tokens, frames]``, a few MB).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

from edserve.tokenizer import WhisperTokenizer

FRAMES_PER_SECOND = 50  # one encoder position per 20 ms
MEDFILT_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = ".。!！?？"
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}


@dataclass
class WordTiming:
    """One word: its text (leading space kept), tokens, times in seconds and probability
    (the mean of its tokens' probabilities)."""

    word: str
    tokens: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    probability: float = 0.0


def default_alignment_heads(num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """Every head of the second half of the decoder layers (openai-whisper's default)."""
    return [(layer, h) for layer in range(num_layers // 2, num_layers) for h in range(num_heads)]


def alignment_heads(config: dict, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs: the checkpoint's ``alignment_heads`` (CTranslate2 config.json, HF
    ``generation_config.alignment_heads``), else :func:`default_alignment_heads`."""
    heads = config.get("alignment_heads")
    if not heads:
        return default_alignment_heads(num_layers, num_heads)
    return [(int(layer), int(h)) for layer, h in heads]


def median_filter(x: np.ndarray, width: int = MEDFILT_WIDTH) -> np.ndarray:
    """Median over a sliding window on the last axis, edges reflected (odd ``width``)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1)


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through ``x`` ``[N, M]`` from (0, 0) to (N-1, M-1); steps
    go diagonal, down (next token) or right (next frame), ties as openai-whisper breaks them.
    Returns (token indices, frame indices) along the path. Computed by anti-diagonals."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    cost[0, 0] = 0.0
    for d in range(2, n + m + 1):  # cells (i, j) with i + j = d, i in 1..n, j in 1..m
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = x[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    arr = np.array(path[::-1])
    return arr[:, 0], arr[:, 1]


def split_words(tok: WhisperTokenizer, tokens: list[int], language: str | None
                ) -> tuple[list[str], list[list[int]]]:
    """Tokens -> words (each with its tokens): per character (whole UTF-8 characters) for
    languages without spaces, else at spaces, punctuation and special tokens."""
    subwords, subtokens = _split_on_unicode(tok, tokens)
    if language in NO_SPACE_LANGUAGES:
        return subwords, subtokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for sub, ids in zip(subwords, subtokens, strict=True):
        new = ids[0] >= tok.eot or sub.startswith(" ") or sub.strip() in string.punctuation
        if new or not words:
            words.append(sub)
            word_tokens.append(list(ids))
        else:
            words[-1] += sub
            word_tokens[-1].extend(ids)
    return words, word_tokens


def _split_on_unicode(tok: WhisperTokenizer, tokens: list[int]
                      ) -> tuple[list[str], list[list[int]]]:
    full = tok.decode(tokens)
    words: list[str] = []
    word_tokens: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for t in tokens:
        current.append(t)
        text = tok.decode(current)
        bad = text.find("\ufffd")
        if bad < 0 or (offset + bad < len(full) and full[offset + bad] == "\ufffd"):
            words.append(text)
            word_tokens.append(current)
            current = []
            offset += len(text)
    return words, word_tokens


def merge_punctuations(words: list[WordTiming], prepended: str = PREPEND_PUNCTUATIONS,
                       appended: str = APPEND_PUNCTUATIONS) -> list[WordTiming]:
    """Attach opening punctuation to the next word and closing punctuation to the previous
    one (openai-whisper's rules); returns the non-empty words."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            nxt.word, nxt.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev.word.endswith(" ") and nxt.word in appended:
            prev.word, prev.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            nxt.word, nxt.tokens = "", []
        else:
            i = j
        j += 1
    return [w for w in words if w.word]


def find_alignment(weights: np.ndarray, tok: WhisperTokenizer, text_tokens: list[int],
                   sot_len: int, num_frames: int, language: str | None,
                   text_probs: list[float] | None = None) -> list[WordTiming]:
    """openai-whisper's ``find_alignment`` on given weights: the words of ``text_tokens`` with
    raw DTW times in seconds from the window's start (no clipping, no punctuation merging).

    ``weights``: ``[heads, sot_len + len(text_tokens) + 1, >= num_frames // 2]`` softmaxed
    cross-attention weights of the sequence ``sot sequence + text + eot`` (row ``r`` is the
    query at position ``r``; ``sot_len`` counts every token before the text, ``<|notimestamps|>``
    included); ``num_frames``: the window's mel frames (10 ms each). The weights are cut to the
    window's ``num_frames // 2`` encoder positions and renormalised over them (openai-whisper
    softmaxes the cut logits: the same numbers). ``text_probs``: per text token, its
    probability; a word's probability is the mean over its tokens."""
    if not text_tokens or num_frames // 2 < 1:
        return []
    w = np.asarray(weights, dtype=np.float64)[:, :, : num_frames // 2]
    w = w / w.sum(axis=-1, keepdims=True)
    w = (w - w.mean(axis=-2, keepdims=True)) / w.std(axis=-2, keepdims=True)
    matrix = median_filter(w).mean(axis=0)[sot_len - 1:-1]  # row k predicts text_tokens[k]
    text_idx, time_idx = dtw(-matrix)
    words, word_tokens = split_words(tok, text_tokens + [tok.eot], language)
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / FRAMES_PER_SECOND
    starts, ends = jump_times[bounds[:-1]], jump_times[bounds[1:]]
    probs = np.asarray(text_probs if text_probs is not None else [0.0] * len(text_tokens),
                       dtype=np.float64)
    word_probs = [float(probs[i:j].mean()) for i, j in zip(bounds[:-1], bounds[1:], strict=True)]
    return [WordTiming(word, toks, float(s), float(e), p) for word, toks, s, e, p in
            zip(words[:-1], word_tokens[:-1], starts, ends, word_probs, strict=True)]


def median_word_duration(words: list[WordTiming]) -> float:
    """min(0.7 s, the median of the non-zero word durations); 0 when there are none."""
    durations = np.array([w.end - w.start for w in words])
    durations = durations[durations.nonzero()]
    return min(0.7, float(np.median(durations))) if len(durations) else 0.0


def word_timings(weights: np.ndarray, tok: WhisperTokenizer, text_tokens: list[int],
                 sot_len: int, num_frames: int, language: str | None,
                 text_probs: list[float] | None = None) -> list[WordTiming]:
    """:func:`find_alignment`, then long words at sentence ends clipped and punctuation
    merged (openai-whisper's ``add_word_timestamps`` before it splits words by segment)."""
    words = find_alignment(weights, tok, text_tokens, sot_len, num_frames, language, text_probs)
    return merge_punctuations(clip_long_words(words))


def clip_long_words(words: list[WordTiming]) -> list[WordTiming]:
    """Words longer than twice the median duration (at most 1.4 s) next to a sentence end are
    cut to that length (openai-whisper's heuristic); in place, returns ``words``."""
    if not words or not any(w.end - w.start for w in words):
        return words
    max_duration = 2 * median_word_duration(words)
    for i in range(1, len(words)):
        if words[i].end - words[i].start > max_duration:
            if words[i].word in SENTENCE_END:
                words[i].end = words[i].start + max_duration
            elif words[i - 1].word in SENTENCE_END:
                words[i].start = words[i].end - max_duration
    return words
