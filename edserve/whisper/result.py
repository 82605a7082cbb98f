"""What a transcription returns: timed segments and the joined text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Word:
    """One timed word (openai-whisper's word object; times in seconds from the start, rounded
    to 10 ms). ``word`` keeps its leading space: a segment's words concatenate to its text."""

    word: str
    start: float
    end: float
    probability: float = 0.0


@dataclass
class Segment:
    """One timed piece of text (openai-whisper's segment; times in seconds from the start)."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    seek: int = 0  # mel frame (10 ms) where this segment's 30 s window started
    words: list[Word] | None = None  # with word timestamps (TranscribeOptions.word_timestamps)
    # the engine's log-probability of each of ``tokens`` (GenerateOutput.logprobs of the
    # window's accepted attempt: the log-softmax after the logit filters, before temperature)
    token_logprobs: list[float] = field(default_factory=list)

    def text_logprobs(self, eot: int) -> list[tuple[int, float]]:
        """(token, log-probability) of each text token (``< eot``: those ``text`` decodes
        from), in order. ValueError when ``token_logprobs`` does not match ``tokens`` (a
        segment built without them)."""
        if len(self.token_logprobs) != len(self.tokens):
            raise ValueError(f"segment {self.id}: {len(self.tokens)} tokens but "
                             f"{len(self.token_logprobs)} log-probabilities")
        return [(t, lp) for t, lp in zip(self.tokens, self.token_logprobs, strict=True)
                if t < eot]


@dataclass
class Transcription:
    source: str
    text: str
    duration: float
    language: str  # code ("en"): given, detected on the first window, or "en" (English-only)
    segments: list[Segment]
    language_probability: float | None = None  # of the detected language (None: not detected)
    words: list[Word] | None = None  # every segment's words in order (word timestamps only)


def join_text(segments: list[Segment]) -> str:
    """The transcript of ``segments``: their texts concatenated, outer whitespace stripped."""
    return "".join(s.text for s in segments).strip()
