"""Parse and validate the multipart form of ``/v1/audio/transcriptions`` and ``/translations``.

Every problem raises :class:`~edserve.server.errors.APIError` (400, or 413 for an oversized file)
naming the offending field, before any audio is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import FormData, UploadFile

from edserve.config import check_mel_padding
from edserve.engine.request import MAX_GROUP_ROWS, MAX_PATIENCE
from edserve.server.errors import APIError

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


@dataclass(frozen=True)
class TranscriptionParams:
    """The validated request fields (``file`` already read into ``audio_bytes``)."""

    audio_bytes: bytes
    filename: str
    model: str
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    granularities: tuple[str, ...]
    stream: bool
    # Decoding (edserve's extra fields; None: the server's --beam-size / --best-of, and
    # openai-whisper's defaults for patience / length_penalty).
    beam_size: int | None = None
    best_of: int | None = None
    patience: float | None = None
    length_penalty: float | None = None
    mel_padding: str | None = None  # None: the server's --mel-padding
    # include[]=logprobs: each text token's log-probability (response_format=json only)
    logprobs: bool = False


def _single(form: FormData, name: str) -> Any:
    """The one value of field ``name`` (None when absent); given more than once: 400 (which
    of two files or two languages was meant is not for the server to guess)."""
    values = form.getlist(name)
    if len(values) > 1:
        raise APIError(400, f"'{name}' was given {len(values)} times; give it once", name,
                       "duplicate_field")
    return values[0] if values else None


def _one(form: FormData, name: str) -> str | None:
    value = _single(form, name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise APIError(400, f"'{name}' must be a text field, not a file", name)
    return value


def _short(value: Any) -> str:
    """A client's field value for an error text (at most 32 characters, files by type)."""
    text = value if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= 32 else text[:32] + "..."


def _temperature(raw: str | None) -> float:
    if raw is None or raw.strip() == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise APIError(400, f"'temperature' must be a number, got {raw!r}", "temperature",
                       "invalid_value") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise APIError(400, f"'temperature' must be between 0 and 1, got {raw}", "temperature",
                       "invalid_value")
    return value


def _group_size(raw: str | None, name: str) -> int | None:
    """``beam_size`` / ``best_of``: an integer in 1..MAX_GROUP_ROWS (empty: the default)."""
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_GROUP_ROWS:
        raise APIError(400, f"'{name}' must be an integer from 1 to {MAX_GROUP_ROWS}, got "
                       f"{_short(raw)!r}", name, "invalid_value")
    return value


def _float_in(raw: str | None, name: str, low: float, high: float, low_open: bool,
              what: str) -> float | None:
    """A finite float in [low, high] (``(low, high]`` when ``low_open``); empty: None."""
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    ok = (value > low if low_open else value >= low) and value <= high  # False for nan
    if not ok or not math.isfinite(value):
        raise APIError(400, f"'{name}' must be {what}, got {_short(raw)!r}", name,
                       "invalid_value")
    return value


def _mel_padding(raw: str | None) -> str | None:
    """``silence`` or ``zeros`` (empty: the server's default)."""
    if raw is None or raw.strip() == "":
        return None
    try:
        return check_mel_padding(raw.strip())
    except ValueError as exc:
        raise APIError(400, str(exc), "mel_padding", "invalid_value") from None


def _decoding(form: FormData) -> dict[str, Any]:
    """The beam search / best-of / mel padding fields (see :class:`TranscriptionParams`)."""
    return dict(
        mel_padding=_mel_padding(_one(form, "mel_padding")),
        beam_size=_group_size(_one(form, "beam_size"), "beam_size"),
        best_of=_group_size(_one(form, "best_of"), "best_of"),
        patience=_float_in(_one(form, "patience"), "patience", 0.0, MAX_PATIENCE, True,
                           f"a number > 0 and <= {MAX_PATIENCE:g}"),
        length_penalty=_float_in(_one(form, "length_penalty"), "length_penalty", 0.0, 10.0,
                                 False, "a number between 0 and 10"))


def _stream(raw: str | None) -> bool:
    """``true``/``false`` in their usual text forms; absent, empty or ``null``: not set."""
    if raw is None or raw.strip().lower() in _FALSE + ("null",):
        return False
    if raw.strip().lower() in _TRUE:
        return True
    raise APIError(400, f"'stream' must be true or false, got {raw!r}", "stream", "invalid_value")


def _include(form: FormData, fmt: str) -> bool:
    """``include[]`` (or ``include``): OpenAI's extra outputs; only ``logprobs`` (each text
    token's log-probability), and as OpenAI's API only with ``response_format=json``
    (streamed or not). Returns whether it was asked for; anything else: 400 naming
    ``include[]``."""
    values = form.getlist("include[]") + form.getlist("include")
    for v in values:
        if v != "logprobs":
            raise APIError(400, f"'include[]' values must be 'logprobs', got {_short(v)!r}",
                           "include[]", "invalid_value")
    if values and fmt != "json":
        raise APIError(400, "'include[]=logprobs' requires response_format=json (got "
                       f"{fmt!r}), as OpenAI's API", "include[]", "invalid_value")
    return bool(values)


# Fields other servers take (vLLM's sampling extras, OpenAI's chunking for its newer models)
# that would change the transcript and are not implemented here: refused unless at their no-op
# value (numbers: the value itself; text: absent or empty), never silently ignored.
NO_OP_NUMBERS = {"top_p": (1.0,), "top_k": (-1.0, 0.0), "min_p": (0.0,),
                 "repetition_penalty": (1.0,), "frequency_penalty": (0.0,),
                 "presence_penalty": (0.0,)}
NO_OP_TEXT = {"seed": (), "to_language": (), "chunking_strategy": ("auto",)}


def _check_unsupported(form: FormData) -> None:
    for name, no_ops in NO_OP_NUMBERS.items():
        raw = _one(form, name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if value not in no_ops:
            raise APIError(400, f"'{name}' is not supported by this server (got "
                           f"{_short(raw)!r}); omit it", name, "unsupported_value")
    for name, no_ops in NO_OP_TEXT.items():
        raw = _one(form, name)
        if raw is not None and raw.strip() and raw.strip() not in no_ops:
            raise APIError(400, f"'{name}' is not supported by this server (got "
                           f"{_short(raw)!r}); omit it", name, "unsupported_value")


def _granularities(form: FormData) -> tuple[str, ...]:
    """``segment`` and/or ``word`` (word: word timestamps, ``words`` in verbose_json)."""
    values = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    out: list[str] = []
    for v in values:
        if not isinstance(v, str) or v not in GRANULARITIES:
            raise APIError(400, f"'timestamp_granularities[]' values must be 'segment' or 'word', "
                           f"got {v!r}", "timestamp_granularities[]", "invalid_value")
        out.append(v)
    return tuple(dict.fromkeys(out))


def mib_label(mib: float) -> str:
    """``25.0`` -> ``"25 MiB"``: a limit as configured, for error texts."""
    return f"{mib:g} MiB"


async def parse_form(form: FormData, max_upload_mb: float,
                     reserve: Callable[[int], Awaitable[None]] | None = None
                     ) -> TranscriptionParams:
    """Validate ``form`` and read the uploaded file (413 when over ``max_upload_mb`` MiB).
    ``await reserve(nbytes)`` runs before the file is read into memory (it may wait, or
    refuse)."""
    upload = _single(form, "file")
    if upload is None:
        raise APIError(400, "'file' is required: upload the audio as a multipart file field",
                       "file", "missing_required_parameter")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "'file' must be a file upload, not a text field", "file")
    fmt = _one(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise APIError(400, f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}; "
                       f"got {fmt!r}", "response_format", "invalid_value")
    model = _one(form, "model")
    if not model:
        raise APIError(400, "'model' is required", "model", "missing_required_parameter")
    logprobs = _include(form, fmt)
    _check_unsupported(form)
    granularities = _granularities(form)
    if granularities and fmt != "verbose_json":  # as OpenAI's API: only verbose_json has them
        raise APIError(400, "'timestamp_granularities[]' requires response_format=verbose_json "
                       f"(got {fmt!r}): only verbose_json carries segments and words",
                       "timestamp_granularities[]", "invalid_value")
    language = (_one(form, "language") or "").strip().lower() or None
    params = dict(model=model, language=language, prompt=_one(form, "prompt") or None,
                  response_format=fmt, temperature=_temperature(_one(form, "temperature")),
                  granularities=granularities, stream=_stream(_one(form, "stream")),
                  logprobs=logprobs, **_decoding(form))
    max_upload_bytes = int(max_upload_mb * 2**20)
    if upload.size is not None and upload.size > max_upload_bytes:
        raise APIError(413, f"'file' exceeds the {mib_label(max_upload_mb)} upload limit",
                       "file", "file_too_large")
    if reserve is not None:
        await reserve(upload.size if upload.size is not None else max_upload_bytes)
    data = await upload.read(max_upload_bytes + 1)
    if len(data) > max_upload_bytes:
        raise APIError(413, f"'file' exceeds the {mib_label(max_upload_mb)} upload limit",
                       "file", "file_too_large")
    if not data:
        raise APIError(400, "'file' is empty (0 bytes)", "file", "empty_file")
    return TranscriptionParams(audio_bytes=data, filename=upload.filename or "audio", **params)
