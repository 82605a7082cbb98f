"""Errors raised while turning user-supplied audio into samples.

All are ``ValueError`` subclasses, so a server can map any of them to HTTP 400 with one
``except AudioError``.
"""


class AudioError(ValueError):
    """The input cannot be used as audio; the message names the input."""


class AudioDecodeError(AudioError):
    """The input is unreadable, corrupt, or not audio (no decodable audio stream)."""


class EmptyAudioError(AudioError):
    """The input decodes (or is empty) but holds no audio samples."""
