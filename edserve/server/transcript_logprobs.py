"""``include[]=logprobs`` for ``/v1/audio/transcriptions`` (and ``/translations``): the
log-probability of each token of the returned text, in OpenAI's shape (``logprobs``: a list
of ``{"token", "logprob", "bytes"}``; with ``response_format=json``, and on each
``transcript.text.delta`` / ``transcript.text.done`` event of a stream).

Entries cover Whisper's text tokens only (``< eot``: no special or timestamp tokens) of every
segment of the transcript, in order over the long-form windows; each window's from its
accepted attempt (temperature fallback). The log-probability is the engine's
(:attr:`~edserve.engine.outputs.GenerateOutput.logprobs`, carried in
:attr:`~edserve.whisper.result.Segment.token_logprobs`): the log-softmax of the logits after
Whisper's logit filters (suppressed tokens, timestamp rules), before temperature. ``token`` is
the token decoded alone (a piece of a multi-byte character shows as U+FFFD, as in
:mod:`~edserve.server.chat_logprobs`); ``bytes`` is the token's own byte-level piece
(:meth:`~edserve.tokenizer.WhisperTokenizer.token_bytes`), so the entries' bytes concatenate
to the UTF-8 of the segments' texts joined, of which the response's ``text`` is the strip
(Whisper's text starts with a space: the first token's ``" And"`` is ``"And"`` in ``text``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from edserve.server.chat_logprobs import token_entry
from edserve.whisper.result import Segment


def segment_logprobs(tokenizer: Any, segment: Segment) -> list[dict[str, Any]]:
    """One entry per text token of ``segment`` (ValueError if it has no log-probabilities)."""
    return [token_entry(tokenizer, t, lp) for t, lp in segment.text_logprobs(tokenizer.eot)]


def transcript_logprobs(tokenizer: Any, segments: Iterable[Segment]) -> list[dict[str, Any]]:
    """The entries of every segment, in order: the ``logprobs`` of a transcription."""
    return [e for s in segments for e in segment_logprobs(tokenizer, s)]
