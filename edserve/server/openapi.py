"""The OpenAPI document served at ``/openapi.json`` (and the Swagger UI at ``/docs``).

The handlers read their bodies by hand (upload limits, OpenAI-style errors), so FastAPI cannot
infer the request and response shapes: each route passes its operation here as
``openapi_extra`` (:func:`audio_operation`, :func:`chat_operation`, ...), and
:func:`install_openapi` adds the components (the models of :mod:`.schemas` and
:mod:`.chat_schemas`, the audio form) to FastAPI's generated document.

Server-sent event streams are described the JSON Schema way (OpenAPI 3.1): the schema of
``text/event-stream`` is one event (``event``, ``data``), whose ``data`` holds JSON
(``contentMediaType``) of the ``contentSchema`` given.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from edserve.server import chat_schemas as chat
from edserve.server import schemas as s

REF = "#/components/schemas/{model}"
MODELS: tuple[type[BaseModel], ...] = (
    s.ErrorResponse, s.TranscriptionJson, s.TranscriptionVerboseJson, s.TranscriptTextDelta,
    s.TranscriptTextDone, s.StreamError, s.ModelList, chat.ChatRequest, chat.ChatCompletion,
    chat.ChatCompletionChunk)
ERRORS = {
    400: "Invalid request: a field is missing or out of range, the audio cannot be decoded, "
         "or the served model cannot do this (the error names the field).",
    401: "Missing or wrong API key (when the server has one): send 'Authorization: Bearer "
         "KEY'.",
    403: "A browser Origin not allowed by --allowed-origins, or (loopback servers) a Host "
         "header other than localhost.",
    404: "The model is not served here.",
    408: "The request body stalled for more than --body-timeout seconds.",
    413: "The body exceeds the --max-upload-mb limit.",
    429: "Too many requests (debug endpoints); see Retry-After.",
    500: "The engine failed on this request, or an internal error.",
    503: "Busy (too much audio waiting to be decoded) or no engine worker ready; see "
         "Retry-After.",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                               "schema": {"type": "integer", "minimum": 1}}}


def api_version() -> str:
    """edserve's installed version (``0+unknown`` when run from a source tree only)."""
    try:
        return version("edserve")
    except PackageNotFoundError:
        return "0+unknown"


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def errors(*codes: int) -> dict[str, Any]:
    """Error responses (OpenAI's error body) for ``codes``."""
    out: dict[str, Any] = {}
    for code in codes:
        out[str(code)] = body = {"description": ERRORS[code], "content": {
            "application/json": {"schema": ref("ErrorResponse")}}}
        if code in (429, 503):
            body["headers"] = RETRY_AFTER
        if code == 401:
            body["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def sse(data_schema: dict[str, Any]) -> dict[str, Any]:
    """``text/event-stream`` content: each event's ``data`` is JSON matching ``data_schema``
    (``event`` is ``error`` for a :class:`~.schemas.StreamError`, else absent)."""
    event = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string", "enum": ["message", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": data_schema}}}
    return {"text/event-stream": {"schema": event}}


def audio_operation(task: str) -> dict[str, Any]:
    """``/v1/audio/transcriptions`` (``transcribe``) or ``/translations`` (``translate``)."""
    what = "Transcribe audio in its language" if task == "transcribe" else \
        "Translate audio into English text (multilingual models)"
    return {
        "summary": what,
        "description": f"{what}, in any length (30 s windows decoded in the engine's "
                       "continuous batch). OpenAI-compatible, plus beam search fields.",
        "requestBody": {"required": True, "content": {
            "multipart/form-data": {"schema": ref("AudioForm")}}},
        "responses": {"200": {"description": "The transcript, as `response_format` asks; with "
                                           "`stream=true` server-sent events.", "content": {
            "application/json": {"schema": {"anyOf": [ref("TranscriptionJson"),
                                                      ref("TranscriptionVerboseJson")]}},
            "text/plain": {"schema": {"type": "string",
                                      "description": "text, srt or vtt"}},
            **sse(ref("TranscriptionStreamEvent"))}},
            **errors(400, 401, 403, 404, 408, 413, 500, 503)}}


def chat_operation() -> dict[str, Any]:
    done = {"if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [ref("ChatCompletionChunk"),
                                                 ref("StreamError")]}}}
    stream = sse({})
    stream["text/event-stream"]["schema"]["properties"]["data"] = {"type": "string", **done}
    return {
        "summary": "Chat with a Llama-3.2-Vision (Mllama) model (text and data: URL images)",
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref("ChatRequest")}}},
        "responses": {"200": {"description": "The completion; with `stream`: chunks, then "
                                           "`data: [DONE]`.", "content": {
            "application/json": {"schema": ref("ChatCompletion")}, **stream}},
            **errors(400, 401, 403, 404, 408, 413, 500, 503)}}


def models_operation() -> dict[str, Any]:
    return {"summary": "The served model", "responses": {"200": {
        "description": "One model card.",
        "content": {"application/json": {"schema": ref("ModelList")}}}, **errors(401, 403)}}


def plain_operation(summary: str, media_type: str, schema: dict[str, Any],
                    *codes: int) -> dict[str, Any]:
    """A route with one success body (health, metrics, debug)."""
    return {"summary": summary, "responses": {"200": {
        "description": "OK", "content": {media_type: {"schema": schema}}}, **errors(*codes)}}


def components(model_ids: list[str], languages: list[str] | None) -> dict[str, Any]:
    """Every schema the operations reference, by name."""
    _, top = models_json_schema([(m, "serialization") for m in MODELS], ref_template=REF)
    out = dict(top["$defs"])
    out["ChatRequest"] = models_json_schema([(chat.ChatRequest, "validation")],
                                            ref_template=REF)[1]["$defs"]["ChatRequest"]
    out["AudioForm"] = s.audio_form_schema(model_ids, languages)
    out["TranscriptionStreamEvent"] = {"anyOf": [ref("TranscriptTextDelta"),
                                                 ref("TranscriptTextDone"), ref("StreamError")]}
    return out


def model_languages(tokenizer: Any) -> list[str] | None:
    """The language codes a Whisper tokenizer takes (``["en"]`` when English-only); None for
    other models."""
    if not hasattr(tokenizer, "is_multilingual"):
        return None
    return list(tokenizer.all_language_codes) if tokenizer.is_multilingual else ["en"]


def install_openapi(app: FastAPI, model_ids: list[str], api_key: bool,
                    languages: list[str] | None = None) -> None:
    """Make ``app.openapi()`` return the full document (built once). ``api_key``: the
    ``/v1`` routes need a bearer token; ``languages``: see :func:`model_languages`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version,
                              description=app.description, routes=app.routes)
            found = doc.setdefault("components", {}).setdefault("schemas", {})
            found.update(components(model_ids, languages))
            if api_key:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                   "scheme": "bearer"}}
                for path, item in doc["paths"].items():
                    if path.startswith(("/v1/", "/debug/")):
                        for op in item.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
