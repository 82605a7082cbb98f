"""One decoded 30 s window into segments (openai-whisper's rules), and its words' times.

Pure functions of a window's tokens and the long-form position (``seek``, in mel frames): the
:class:`~edserve.whisper.longform.LongformTask` state machine calls them and keeps the returned
position. Segments are cut at pairs of timestamp tokens; the next window starts at the last
complete timestamp, or at the window's end when the text ended with a single timestamp. With
word timestamps the next window starts at the last word's end instead.
"""

from __future__ import annotations

from typing import Any

from edserve.audio.mel import HOP_LENGTH, SAMPLE_RATE
from edserve.tokenizer import WhisperTokenizer
from edserve.whisper.alignment import find_alignment
from edserve.whisper.result import Segment
from edserve.whisper.words import add_word_timestamps, cut_points, last_word_end

TIME_PRECISION = 0.02  # seconds per timestamp token
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # mel frames (100)
INPUT_STRIDE = 2  # mel frames per encoder position (3000 frames -> 1500 states)


def make_segment(tok: WhisperTokenizer, tokens: list[int], start: float, end: float,
                 duration: float, stats: dict, logprobs: list[float] | None = None) -> Segment:
    """A segment of ``tokens`` (``logprobs``: theirs, one each) between ``start`` and ``end``
    seconds, clipped to the audio."""
    end = min(end, duration)
    start = min(start, end)
    text_tokens = [t for t in tokens if t < tok.eot]
    return Segment(0, round(start, 3), round(end, 3), tok.decode(text_tokens), tokens,
                   token_logprobs=list(logprobs or []), **stats)


def split_window(tok: WhisperTokenizer, tokens: list[int], seek: int, size: int,
                 duration: float, stats: dict, logprobs: list[float] | None = None
                 ) -> tuple[list[Segment], int]:
    """Cut a window's tokens (decoded at frame ``seek``, ``size`` frames long) into segments
    at timestamp pairs; returns them (each with ``seek`` set) and the next window's start,
    which is always past ``seek``. ``logprobs`` (one per token, or None) are cut the same way
    into each segment's ``token_logprobs``."""
    if logprobs is not None and len(logprobs) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} log-probabilities")
    lps = logprobs if logprobs is not None else []
    tb = tok.timestamp_begin
    offset = seek * HOP_LENGTH / SAMPLE_RATE
    cuts, single_ending = cut_points(tokens, tb)
    segments = []
    if cuts:
        last = 0
        for cut in cuts:
            piece = tokens[last:cut]
            segments.append(make_segment(tok, piece, offset + (piece[0] - tb) * TIME_PRECISION,
                                         offset + (piece[-1] - tb) * TIME_PRECISION, duration,
                                         stats, lps[last:cut]))
            last = cut
        advance = size if single_ending else (tokens[last - 1] - tb) * INPUT_STRIDE
    else:
        window_s = size * HOP_LENGTH / SAMPLE_RATE
        stamps = [t for t in tokens if t >= tb]
        if stamps and stamps[-1] != tb:
            window_s = (stamps[-1] - tb) * TIME_PRECISION
        segments.append(make_segment(tok, tokens, offset, offset + window_s, duration, stats,
                                     lps))
        advance = size
    for s in segments:
        s.seek = seek
    return segments, seek + (advance if advance > 0 else size)


def place_words(tok: WhisperTokenizer, segments: list[Segment], alignment: Any, size: int,
                tokens: list[int], language: str | None, task: str, timestamps: bool,
                seek: int, last_speech: float) -> tuple[int, float]:
    """Words for a window's segments from its alignment readout (``seek`` already advanced by
    :func:`split_window`); returns the next window's start (the last word's end when the
    window was decoded with timestamps and did not end on a single timestamp) and the end of
    the last speech so far."""
    if not segments:
        return seek, last_speech
    offset = segments[0].seek * HOP_LENGTH / SAMPLE_RATE
    text = [t for s in segments for t in s.tokens if t < tok.eot]
    raw = []
    if alignment is not None and text:
        sot_len = len(tok.sot_sequence(language, task, timestamps=False))
        raw = find_alignment(alignment.weights.numpy(), tok, text, sot_len, size, language,
                             alignment.text_probs)
    add_word_timestamps(segments, raw, tok.eot, offset, last_speech)
    _, single_ending = cut_points(tokens, tok.timestamp_begin)
    end = last_word_end(segments)
    if timestamps and not single_ending and end is not None and end > offset:
        seek = round(end * FRAMES_PER_SECOND)
    return seek, (end if end is not None else last_speech)
