"""Schemathesis fuzz of the live server (tiny.en on CPU): from its own ``/openapi.json`` and
from OpenAI's official spec of the audio and models paths (tests/data/openai-openapi). No case
may get a 5xx, and every response must match the schema (streamed events included).

Half the cases that send a ``file`` send 1.5 s of real speech to a served model (see ``real``),
so that many requests run a real (short) transcription. ``EDSERVE_FUZZ_EXAMPLES`` sets the
cases per operation (CI: 20; the ~2,800-case run in benchmarks/RESULTS.md: 350).
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

EXAMPLES = int(os.environ.get("EDSERVE_FUZZ_EXAMPLES", "20"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OPENAI_SPEC = DATA / "openai-openapi" / "audio_models.json"


@pytest.fixture(scope="module")
def real():
    """What half the audio cases become: 1.5 s of speech ("And so my fellow...") sent to a
    served model, without the fields the server always refuses (include[] beside a format
    other than json; timestamp granularities beside a format other than verbose_json; a
    chunking strategy other than auto), and with at most 4 beams
    or samples (16 rows through up to six fallback temperatures take minutes on CPU); every
    other field stays as generated."""
    speech = wav_bytes(load_audio(DATA / "jfk.wav")[:24000])

    def fix(body: dict) -> dict:
        if body.get("response_format", "json") != "json":
            body.pop("include[]", None)
            body.pop("include", None)
        if body.get("chunking_strategy") != "auto":  # server_vad objects: refused (400)
            body.pop("chunking_strategy", None)
        if body.get("response_format") != "verbose_json":
            body.pop("timestamp_granularities[]", None)
            body.pop("timestamp_granularities", None)
        for name in ("beam_size", "best_of"):
            if isinstance(body.get(name), int):
                body[name] = min(body[name], 4)
        return {**body, "file": speech, "model": "whisper-1"}

    return fix


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


VERBOSE = {"/audio/transcriptions": "CreateTranscriptionResponseVerboseJson",
           "/audio/translations": "CreateTranslationResponseVerboseJson"}


def _media(response) -> str:
    return response.headers.get("content-type", [""])[0].split(";")[0]


def test_fuzz_openai_spec(base_url, http, real):
    doc = json.loads(OPENAI_SPEC.read_text())
    schema = schemathesis.openapi.from_dict(doc)
    # OpenAI's spec documents only 200 (and 429) and application/json for every
    # response_format: only these checks apply (README, "OpenAPI").
    checks = [not_a_server_error, response_schema_conformance]
    streams: list[str] = []
    verbose: list[tuple[str, dict]] = []

    def skip(case, response) -> bool:
        """Responses the spec describes wrongly, validated below against what it means:
        stream payloads (the spec gives them as the event schema) and verbose_json (valid
        under both of its non-exclusive ``oneOf`` branches, json and verbose_json)."""
        if _media(response) == "text/event-stream":
            streams.append(response.content.decode())
            return True
        body = case.body if isinstance(case.body, dict) else {}
        if response.status_code == 200 and body.get("response_format") == "verbose_json":
            verbose.append((case.path, json.loads(response.content)))
            return True
        return False

    counts, failures = fuzz(schema, base_url + "/v1", AUTH, EXAMPLES, checks, real, skip)
    for path in VERBOSE:  # one stream and one verbose_json each, whatever the fuzz drew,
        for fields in ({"stream": True}, {"response_format": "verbose_json"},  # and logprobs
                       {"include": ["logprobs"]}, {"stream": True, "include": ["logprobs"]}):
            case = schema[path]["POST"].Case(body=real({**fields}),
                                              media_type="multipart/form-data")
            response = case.call(base_url=base_url + "/v1", headers=AUTH, timeout=120)
            if response.status_code == 200 and not skip(case, response):
                case.validate_response(response, checks=checks, headers=AUTH)
    assert streams and verbose
    assert not failures, _report(counts, failures)
    _report(counts, failures)
    ok = sum(v for k, v in counts.items() if k.startswith("POST /audio") and k.endswith("200"))
    assert ok >= 3, counts
    _check_meant(doc, streams, verbose)
    integrity(http)


def _check_meant(doc: dict, streams: list[str], verbose: list[tuple[str, dict]]) -> None:
    """Stream payloads against OpenAI's stream event schema, verbose_json bodies against
    its verbose schema."""
    import jsonschema

    from .openapi_check import sse_events

    def validator(name: str):
        return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                                "components": doc["components"]})

    events = validator("CreateTranscriptionResponseStreamEvent")
    for text in streams:
        for e in sse_events(text):
            events.validate(json.loads(e["data"]))
    for path, body in verbose:
        validator(VERBOSE[path]).validate(body)
    print(f"validated separately: {len(streams)} streams, {len(verbose)} verbose_json")
