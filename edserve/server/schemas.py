"""The API's request and response shapes as pydantic models, used only to write the OpenAPI
document (``/openapi.json``): the handlers parse and validate by hand (``params.py``,
``chat.py``) and build plain dicts, and the tests check live responses against these schemas.

Response models forbid extra fields, so a field the server starts sending without documenting
it (or a ``null`` where the schema has none) fails the schema tests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edserve.config import MAX_GROUP_ROWS
from edserve.engine.request import MAX_PATIENCE
from edserve.server.params import GRANULARITIES, RESPONSE_FORMATS


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors -------------------------------------------------------------------------------

class ErrorDetail(_Closed):
    message: str = Field(description="What went wrong, for people.")
    type: str = Field(description="`invalid_request_error` (4xx) or `server_error` (5xx).")
    param: str | None = Field(description="The request field at fault, if any.")
    code: str | None = Field(description="A machine-readable code (`invalid_value`, "
                             "`model_not_found`, `file_too_large`, ...), if any.")


class ErrorResponse(_Closed):
    """Every 4xx/5xx answer (OpenAI's error shape)."""

    error: ErrorDetail


# ---- audio: request -----------------------------------------------------------------------

def _field(kind: str, doc: str, **kw: object) -> dict:
    return {"type": kind, "description": doc, **kw}


def audio_form_schema(model_ids: list[str], languages: list[str] | None) -> dict:
    """JSON schema of the multipart form of ``/v1/audio/transcriptions`` and ``/translations``
    (what ``params.parse_form`` accepts; fields not listed are ignored). ``model_ids``: the
    ids the server answers to; ``languages``: the model's language codes (None: unknown)."""
    granularities = {"type": "array", "items": {"type": "string", "enum": list(GRANULARITIES)},
                     "description": "`word`: word timestamps (`words` in verbose_json); "
                     "`segment`: segment timestamps (always in verbose_json, srt and vtt). "
                     "Only with response_format=verbose_json (400 otherwise)."}
    group = "an integer from 1 to {n} (edserve extension; default: the server's --{flag}); " \
        "more than the server's --max-running-requests: 400."
    props = {
        "file": _field("string", "The audio (flac, mp3, mp4/m4a, ogg, wav, webm, ...): at "
                       "most --max-upload-mb MiB (larger: 413), at most --max-audio-seconds "
                       "long (longer: 400); undecodable or empty: 400.", format="binary"),
        "model": _field("string", "The served model id (--served-model-name) or whisper-1; "
                        "any other: 404.", enum=model_ids),
        "language": _field("string", "ISO-639-1 code of the spoken language (any case); "
                           "omitted or empty: detected (English-only models take only `en`). "
                           "Others: 400.", **({"enum": languages} if languages else {})),
        "prompt": _field("string", "Text that precedes the audio (style, spelling of names), "
                         "given to the first 30 s window."),
        "response_format": _field("string", "json, verbose_json: application/json; text, srt, "
                                  "vtt: text/plain. Others: 400.",
                                  enum=list(RESPONSE_FORMATS), default="json"),
        "temperature": _field("number", "Sampling temperature of the first attempt; a window "
                              "that fails the compression-ratio or log-probability checks is "
                              "decoded again at +0.2 steps up to 1.0. Outside [0, 1]: 400.",
                              minimum=0, maximum=1, default=0),
        "timestamp_granularities[]": granularities,
        "timestamp_granularities": {**granularities, "description": "The same as "
                                    "timestamp_granularities[] (both names are read)."},
        "include[]": {"type": "array", "items": {"type": "string", "enum": ["logprobs"]},
                      "description": "`logprobs`: each text token's log-probability "
                      "(`logprobs` in the json response and on each stream event). Only "
                      "with response_format=json (400 otherwise); other values: 400. The "
                      "name `include` is read as well."},
        "stream": _field("boolean", "true: answer with server-sent events (one "
                         "`transcript.text.delta` per accepted segment, then "
                         "`transcript.text.done`). Text forms: true/false, 1/0, yes/no, "
                         "on/off (any case); empty or `null`: not set (false).",
                         default=False),
        "beam_size": _field("integer", "Beams for windows decoded at temperature 0: " +
                            group.format(n=MAX_GROUP_ROWS, flag="beam-size"),
                            minimum=1, maximum=MAX_GROUP_ROWS),
        "best_of": _field("integer", "Samples per window decoded at temperature > 0 (the most "
                          "likely is kept): " + group.format(n=MAX_GROUP_ROWS, flag="best-of"),
                          minimum=1, maximum=MAX_GROUP_ROWS),
        "patience": _field("number", "Beam search patience (edserve extension): stop after "
                           "round(beam_size * patience) finished candidates (at least 1); "
                           "needs beam_size > 1 (else 400).", exclusiveMinimum=0,
                           maximum=MAX_PATIENCE),
        "length_penalty": _field("number", "Rank finished sequences by sum log-probability / "
                                 "((5 + length) / 6) ** length_penalty (edserve extension; "
                                 "omitted: divided by the length).", minimum=0, maximum=10),
    }
    return {"type": "object", "required": ["file", "model"], "properties": props}


# ---- audio: responses ---------------------------------------------------------------------

class UsageDuration(_Closed):
    type: Literal["duration"]
    seconds: int = Field(description="Audio duration in whole seconds, rounded up.")


class InputTokenDetails(_Closed):
    text_tokens: int = Field(description="Decoder prompt tokens over all windows and attempts.")
    audio_tokens: int = Field(description="Encoder positions attended to (1500 per 30 s "
                              "window attempt).")


class UsageTokens(_Closed):
    type: Literal["tokens"]
    input_tokens: int = Field(description="text_tokens + audio_tokens.")
    input_token_details: InputTokenDetails
    output_tokens: int = Field(description="Tokens generated over all windows and attempts.")
    total_tokens: int = Field(description="input_tokens + output_tokens.")


class TokenLogprob(_Closed):
    """One text token of the transcript (``include[]=logprobs``)."""

    token: str = Field(description="The token decoded alone (a piece of a multi-byte "
                       "character shows as U+FFFD).")
    logprob: float = Field(description="Its log-probability (the model's log-softmax after "
                           "Whisper's token filters, before temperature); <= 0.")
    bytes: list[int] = Field(description="The token's own bytes (byte-level BPE): the "
                             "entries' bytes concatenate to the UTF-8 of the text (before "
                             "its leading space is stripped).")


_LOGPROBS = "With include[]=logprobs: one entry per text token of `text`, in order (no " \
    "special or timestamp tokens); absent otherwise."


class TranscriptionJson(_Closed):
    """``response_format=json``."""

    text: str
    logprobs: list[TokenLogprob] = Field(default_factory=list, description=_LOGPROBS)
    usage: UsageDuration


class Word(_Closed):
    word: str
    start: float = Field(description="Seconds from the start of the audio.")
    end: float


class Segment(_Closed):
    id: int
    seek: int = Field(description="Mel frame (10 ms) where the segment's 30 s window started.")
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionVerboseJson(_Closed):
    """``response_format=verbose_json``; ``words`` only with ``timestamp_granularities[]=word``."""

    task: Literal["transcribe", "translate"]
    language: str = Field(description="The language's English name (`english`).")
    duration: float = Field(description="Audio duration in seconds.")
    text: str
    segments: list[Segment]
    words: list[Word] = Field(default_factory=list, description="Every word, in order.")
    usage: UsageDuration


class TranscriptTextDelta(_Closed):
    """One streamed piece of text (one accepted segment); the deltas concatenate to the text."""

    type: Literal["transcript.text.delta"]
    delta: str
    logprobs: list[TokenLogprob] = Field(default_factory=list, description="With "
                                         "include[]=logprobs: the text tokens of this "
                                         "delta's segment; absent otherwise.")


class TranscriptTextDone(_Closed):
    """The last event of a transcription stream."""

    type: Literal["transcript.text.done"]
    text: str
    logprobs: list[TokenLogprob] = Field(default_factory=list, description=_LOGPROBS + " "
                                         "The deltas' lists concatenate to it.")
    usage: UsageTokens


class StreamError(_Closed):
    """Sent as ``event: error`` when a stream fails after it started (then it ends)."""

    type: Literal["error"]
    error: ErrorDetail


# ---- models -------------------------------------------------------------------------------

class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]
