"""Word timestamps for one window's segments (openai-whisper's ``add_word_timestamps``).

:func:`add_word_timestamps` takes the window's raw alignment (:func:`~edserve.whisper.alignment.
find_alignment` over the text tokens of all the window's segments, in order), clips long words
at sentence ends, merges punctuation, hands the words to the segments by their text-token
counts, and then adjusts: the first word after a long pause is cut to twice the median word
duration, a segment's start/end move to its first/last word unless that word is much longer
than the segment's own timestamp says (then the word is cut instead). Words are rounded to
10 ms like openai-whisper's.
"""

from __future__ import annotations

from edserve.whisper.alignment import (
    WordTiming,
    clip_long_words,
    median_word_duration,
    merge_punctuations,
)
from edserve.whisper.result import Segment, Word


def cut_points(tokens: list[int], timestamp_begin: int) -> tuple[list[int], bool]:
    """Where a window's tokens split into segments (after each pair of timestamp tokens, and
    at the end when the tokens end on a single timestamp), and whether they do."""
    is_ts = [t >= timestamp_begin for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    if cuts and single_ending:
        cuts.append(len(tokens))
    return cuts, single_ending


def segment_text_tokens(tokens: list[int], eot: int, timestamp_begin: int) -> list[int]:
    """The text tokens (``< eot``) of the segments a window's ``tokens`` make (an unfinished
    last segment, decoded again by the next window, is left out)."""
    cuts, _ = cut_points(tokens, timestamp_begin)
    return [t for t in tokens[:cuts[-1] if cuts else len(tokens)] if t < eot]


def add_word_timestamps(segments: list[Segment], alignment: list[WordTiming], eot: int,
                        time_offset: float, last_speech_timestamp: float) -> float:
    """Set ``words`` (and adjust ``start``/``end``) of ``segments`` in place.

    ``alignment``: raw word timings (seconds from the window's start, ``time_offset``) of the
    concatenated text tokens (``< eot``) of ``segments``; ``last_speech_timestamp``: where
    speech last ended (seconds), for the after-a-pause rule. Returns the updated
    ``last_speech_timestamp`` (the end of the last segment that got words)."""
    if not segments:
        return last_speech_timestamp
    median_duration = median_word_duration(alignment)
    max_duration = median_duration * 2
    words = merge_punctuations(clip_long_words(alignment))
    index = 0
    for segment in segments:
        n_text = sum(1 for t in segment.tokens if t < eot)
        saved, out = 0, []
        while index < len(words) and saved < n_text:
            timing = words[index]
            out.append(Word(timing.word, round(time_offset + timing.start, 2),
                            round(time_offset + timing.end, 2), timing.probability))
            saved += len(timing.tokens)
            index += 1
        if out:
            _adjust(segment, out, median_duration, max_duration, last_speech_timestamp)
            last_speech_timestamp = segment.end
        segment.words = out
    return last_speech_timestamp


def _adjust(segment: Segment, words: list[Word], median_duration: float, max_duration: float,
            last_speech_timestamp: float) -> None:
    first = words[0]
    # the first (and second) word after a pause: at most twice the median word duration
    if first.end - last_speech_timestamp > median_duration * 4 and (
            first.end - first.start > max_duration
            or (len(words) > 1 and words[1].end - first.start > max_duration * 2)):
        if len(words) > 1 and words[1].end - words[1].start > max_duration:
            boundary = max(words[1].end / 2, words[1].end - max_duration)
            first.end = words[1].start = boundary
        first.start = max(0.0, first.end - max_duration)
    # prefer the segment's start timestamp when the first word is too long
    if segment.start < first.end and segment.start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median_duration, segment.start))
    else:
        segment.start = first.start
    last = words[-1]
    # prefer the segment's end timestamp when the last word is too long
    if segment.end > last.start and segment.end + 0.5 < last.end:
        last.end = max(last.start + median_duration, segment.end)
    else:
        segment.end = last.end


def last_word_end(segments: list[Segment]) -> float | None:
    """The end of the last word of ``segments`` (else the last segment's end; None if no
    segments): openai-whisper's ``get_end``."""
    for s in reversed(segments):
        if s.words:
            return s.words[-1].end
    return segments[-1].end if segments else None
