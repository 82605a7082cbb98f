"""Validate live HTTP responses against an OpenAPI document (the server's own, or OpenAI's),
and fuzz a served API from an OpenAPI document with schemathesis."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import httpx
import jsonschema


def _validate(doc: dict, schema: dict, instance: Any) -> None:
    """``instance`` against ``schema`` whose ``$ref``s point into ``doc``'s components."""
    root = {**schema, "components": doc.get("components", {})}
    jsonschema.Draft202012Validator(root).validate(instance)


def sse_events(text: str) -> list[dict[str, str]]:
    """The events of a ``text/event-stream`` body as ``{"event"?, "data"}`` dicts."""
    events = []
    for block in text.strip().split("\n\n"):
        event: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            event[name] = event[name] + "\n" + value if name == "data" and name in event \
                else value
        events.append(event)
    return events


def check_response(doc: dict, path: str, method: str, response: httpx.Response) -> Any:
    """Assert that ``response`` is documented for ``method path`` and matches its schema;
    for an event stream every event and every ``data`` JSON (its ``contentSchema``).
    Returns the parsed body (JSON, text, or the list of event payloads)."""
    op = doc["paths"][path][method.lower()]
    documented = op["responses"].get(str(response.status_code))
    assert documented is not None, f"{response.status_code} not documented for {path}"
    media = response.headers["content-type"].split(";")[0].strip()
    content = documented.get("content", {})
    assert media in content, f"{media} not documented for {response.status_code} {path}"
    schema = content[media]["schema"]
    if media == "application/json":
        body = response.json()
        _validate(doc, schema, body)
        return body
    if media == "text/event-stream":
        payloads = []
        for event in sse_events(response.text):
            _validate(doc, schema, event)
            data = schema["properties"]["data"]  # contentSchema, or after if [DONE] / else
            content = data.get("contentSchema") or data.get("else", {}).get("contentSchema")
            assert content is not None, data
            if event["data"] == "[DONE]" and "else" in data:
                continue
            payload = json.loads(event["data"])
            _validate(doc, content, payload)
            payloads.append(payload)
        return payloads
    _validate(doc, schema, response.text)
    return response.text


def fuzz(schema: Any, base_url: str, headers: dict[str, str], max_examples: int,
         checks: list, real: Any = None,
         skip: Any = None) -> tuple[Counter, list[str]]:
    """Run ``max_examples`` positive and negative cases per operation of the schemathesis
    ``schema`` against ``base_url`` (derandomized: the same cases every run). With ``real``
    (``body -> body``), half the cases that send a ``file`` are passed through it (e.g. to
    send real speech to a served model), so that many requests do real work. ``skip(case,
    response)``: True to leave a response unchecked. Returns
    (count per ``METHOD path status``, failure texts)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    counts: Counter = Counter()
    failures: list[str] = []

    def with_audio(case: Any, use_real: bool) -> Any:
        if use_real and real is not None and isinstance(case.body, dict) \
                and "file" in case.body:
            case.body = real(dict(case.body))
        return case

    def runner(op: Any) -> Any:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                          op.as_strategy(GenerationMode.NEGATIVE))
        cases = cases.flatmap(lambda c: st.booleans().map(lambda real: with_audio(c, real)))

        @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def run(case: Any) -> None:
            response = case.call(base_url=base_url, headers=headers, timeout=120)
            counts[f"{op.method.upper()} {op.path} {response.status_code}"] += 1
            if os.environ.get("EDSERVE_FUZZ_DEBUG") and response.status_code >= 400:
                print(op.path, str(case.body)[:300], response.text[:300])
            if skip is not None and skip(case, response):
                return
            try:
                case.validate_response(response, checks=checks, headers=headers)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # schemathesis raises an exception group
                # one failure text per distinct problem
                text = f"{op.method.upper()} {op.path} {response.status_code}: {exc}"[:2000]
                if text not in failures:
                    failures.append(text)

        return run

    for result in schema.get_all_operations():
        runner(result.ok())()
    return counts, failures
