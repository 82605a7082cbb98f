"""Schemathesis fuzz of the live server (tiny.en on CPU): from its own ``/openapi.json`` and
from OpenAI's official spec of the audio and models paths (tests/data/openai-openapi). No case
may get a 5xx, and every response must match the schema (streamed events included).

Half the cases that send a ``file`` send 1.5 s of real speech, so valid requests run a real
(short) transcription. ``EDSERVE_FUZZ_EXAMPLES`` sets the cases per operation (CI: 25; the
~3,000-case run recorded in benchmarks/RESULTS.md used 500).
"""

from __future__ import annotations

import json
import os

import pytest

from edserve.audio.decode import load_audio

from .openapi_check import fuzz
from .server_helpers import API_KEY, DATA, integrity, wav_bytes

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("EDSERVE_FUZZ_EXAMPLES", "25"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OPENAI_SPEC = DATA / "openai-openapi" / "audio_models.json"


@pytest.fixture(scope="module")
def real() -> dict:
    """What half the audio cases send: 1.5 s of speech ("And so my fellow...") to a served
    model."""
    return {"file": wav_bytes(load_audio(DATA / "jfk.wav")[:24000]), "model": "whisper-1"}


def _report(counts, failures) -> str:
    lines = [f"{k}: {v}" for k, v in sorted(counts.items())]
    print("\n".join(lines))
    return "\n\n".join(failures)


def test_fuzz_own_schema(base_url, http, real):
    doc = http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance]
    counts, failures = fuzz(schema, base_url, AUTH, EXAMPLES, checks, real)
    assert not failures, _report(counts, failures)
    _report(counts, failures)
    ok = sum(v for k, v in counts.items() if k.startswith("POST /v1/audio") and k.endswith("200"))
    assert ok >= 3, counts  # real transcriptions ran, not only rejections
    integrity(http)


def _sse_data_only(case, response) -> bool:
    """OpenAI's spec gives each streamed event's *payload* as the ``text/event-stream``
    schema, where OpenAPI (3.2, and schemathesis) reads it as the event (``data``,
    ``event``); the payloads are checked against it in :func:`_check_openai_stream`."""
    return response.headers.get("content-type", [""])[0].startswith("text/event-stream")


def test_fuzz_openai_spec(base_url, http, real):
    doc = json.loads(OPENAI_SPEC.read_text())
    schema = schemathesis.openapi.from_dict(doc)
    # OpenAI's spec documents only 200 (and 429), application/json for every response_format
    # and the stream payloads as the event: see README ("Deviations") for why only these
    # checks apply.
    checks = [not_a_server_error, response_schema_conformance]
    streams: list = []

    def skip(case, response) -> bool:
        if _sse_data_only(case, response):
            streams.append((case.path, response.content.decode()))
            return True
        return False

    counts, failures = fuzz(schema, base_url + "/v1", AUTH, EXAMPLES, checks, real, skip)
    assert not failures, _report(counts, failures)
    _report(counts, failures)
    ok = sum(v for k, v in counts.items() if k.startswith("POST /audio") and k.endswith("200"))
    assert ok >= 3, counts
    _check_openai_stream(doc, streams)
    integrity(http)


def _check_openai_stream(doc: dict, streams: list) -> None:
    """Every streamed payload validates against OpenAI's stream event schema."""
    import jsonschema

    from .openapi_check import sse_events

    event = {"$ref": "#/components/schemas/CreateTranscriptionResponseStreamEvent",
             "components": doc["components"]}
    validator = jsonschema.Draft202012Validator(event)
    for _, text in streams:
        for e in sse_events(text):
            validator.validate(json.loads(e["data"]))
