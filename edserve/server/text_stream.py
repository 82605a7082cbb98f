"""Turn growing text into deltas whose concatenation equals the final, stripped text."""

from __future__ import annotations


class TextStream:
    """Feed pieces with :meth:`push`; each call returns the new committed text.

    Leading whitespace is dropped and trailing whitespace held back until more text follows, so
    ``"".join(deltas) == "".join(pieces).strip()`` at every point.
    """

    def __init__(self) -> None:
        self._raw = ""
        self._sent = 0
        self.text = ""

    def push(self, piece: str) -> str:
        self._raw += piece
        committed = self._raw.strip()
        delta = committed[self._sent:]
        self._sent = len(committed)
        self.text = committed
        return delta
