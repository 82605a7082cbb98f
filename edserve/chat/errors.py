"""The chat layer's input error (a ``ValueError``; the server answers it with a 400)."""

from __future__ import annotations


class ChatFormatError(ValueError):
    """Malformed chat input; ``param`` names the offending field (user-facing)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param
