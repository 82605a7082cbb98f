"""Errors raised while turning user-supplied audio into samples.

All :class:`AudioError` subclasses are ``ValueError`` subclasses, so a server can map any of
them to HTTP 400 with one ``except AudioError`` (more specific classes first when the answer
should differ). :class:`DecodeCancelled` is deliberately *not* an ``AudioError``: the input was
fine, the caller asked to stop.
"""

from __future__ import annotations


def format_seconds(seconds: float) -> str:
    """``90.0`` -> ``"90"``, ``90.25`` -> ``"90.2"``: one decimal at most, no float noise."""
    text = f"{seconds:.1f}"
    return text[:-2] if text.endswith(".0") else text


class AudioError(ValueError):
    """The input cannot be used as audio; for trusted inputs the message names the input."""


class AudioDecodeError(AudioError):
    """The input is unreadable, corrupt, not audio, or a container format that is not allowed."""


class EmptyAudioError(AudioError):
    """The input decodes (or is empty) but holds no audio samples."""


class NonFiniteAudioError(AudioError):
    """The decoded samples contain NaN or +-inf (float PCM can carry them)."""

    def __init__(self, message: str = "audio contains NaN or infinite samples") -> None:
        super().__init__(message)


class AudioTooLongError(AudioError):
    """The audio is longer than the caller's ``max_seconds`` limit.

    ``seconds``: the duration the container declares or, when decoding stopped at the limit,
    how much had been decoded then (``exact`` is False: the audio is *at least* that long).
    ``limit``: the limit in seconds. The message reads "audio is longer than the 90 s limit".
    """

    def __init__(self, seconds: float, limit: float, *, exact: bool) -> None:
        self.seconds = float(seconds)
        self.limit = float(limit)
        self.exact = exact
        length = format_seconds(self.seconds)
        detail = f"{length} s" if exact else f"more than {format_seconds(self.limit)} s"
        super().__init__(
            f"audio is longer than the {format_seconds(self.limit)} s limit ({detail})")

    def __reduce__(self):
        return (_rebuild_too_long, (self.seconds, self.limit, self.exact))


def _rebuild_too_long(seconds: float, limit: float, exact: bool) -> AudioTooLongError:
    return AudioTooLongError(seconds, limit, exact=exact)


class DecodeCancelled(Exception):
    """Decoding stopped because the caller's ``cancel`` event was set (e.g. client gone)."""
