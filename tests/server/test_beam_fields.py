"""The ``beam_size`` / ``best_of`` / ``patience`` / ``length_penalty`` form fields: validated
(400 in OpenAI's shape naming the field), defaulted from the server config, and decoded."""

from __future__ import annotations

import asyncio
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.datastructures import FormData, UploadFile
from whisper_fixtures import TINY_EN_TEXT

from edserve.cli import build_parser
from edserve.config_args import config_from_args
from edserve.engine.request import MAX_GROUP_ROWS
from edserve.server import config as server_config
from edserve.server.config import ServerConfig
from edserve.server.errors import APIError
from edserve.server.params import parse_form
from edserve.server.transcription import build_options, decoding

from .server_helpers import DATA, integrity

JFK = (DATA / "jfk.wav").read_bytes()
BAD = {
    "beam_size": ["0", "17", "abc", "2.5", "-1", "1e3", "nan"],
    "best_of": ["0", "17", "abc", "2.5"],
    "patience": ["0", "-1", "abc", "nan", "inf"],
    "length_penalty": ["-0.1", "10.5", "abc", "nan", "inf"],
}


def _post(http: httpx.Client, path: str = "/v1/audio/transcriptions",
          **fields: str) -> httpx.Response:
    return http.post(path, files={"file": ("jfk.wav", JFK)},
                     data={"model": "whisper-1", **fields})


def _settled(http: httpx.Client, timeout: float = 10.0) -> None:
    """``integrity(http)`` once the engine is idle and every KV slot is back: a beam group's
    held encoder region is handed back (through the engine's inbox) just after the response."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = http.get("/debug/integrity").json()
        if report.get("inflight") == 0 and report.get("kv_slots_used") == 0:
            break
        time.sleep(0.05)
    integrity(http)


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]", "", text.lower()).split()


def _assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert f"'{param}'" in err["message"]


def _parse(**fields: str):
    form = FormData([("model", "whisper-1"), *fields.items(),
                     ("file", UploadFile(io.BytesIO(b"RIFF"), filename="a.wav"))])
    return asyncio.run(parse_form(form, 1.0))


@pytest.mark.parametrize("name,raw", [(n, v) for n, vs in BAD.items() for v in vs])
def test_parse_form_rejects(name, raw):
    with pytest.raises(APIError) as exc_info:
        _parse(**{name: raw})
    assert exc_info.value.status == 400 and exc_info.value.param == name


def test_parse_form_values_and_defaults():
    p = _parse(beam_size=" 5 ", best_of="16", patience="1.5", length_penalty="0")
    assert (p.beam_size, p.best_of, p.patience, p.length_penalty) == (5, 16, 1.5, 0.0)
    p = _parse(beam_size="", patience="")  # empty: as absent
    assert (p.beam_size, p.best_of, p.patience, p.length_penalty) == (None, None, None, None)


def test_options_default_to_server_config():
    cfg = ServerConfig(beam_size=4, best_of=3)
    opts = build_options(_parse(), "transcribe", cfg, seed=0)
    assert (opts.beam_size, opts.best_of, opts.patience, opts.length_penalty) == \
        (4, 3, None, None)
    opts = build_options(_parse(beam_size="2", best_of="1", patience="2", length_penalty="1"),
                         "transcribe", cfg, seed=0)
    assert (opts.beam_size, opts.best_of, opts.patience, opts.length_penalty) == (2, 1, 2.0, 1.0)
    with pytest.raises(APIError) as exc_info:  # patience without beam search
        build_options(_parse(patience="2"), "transcribe", ServerConfig(), seed=0)
    assert exc_info.value.param == "patience"
    for name in ("beam_size", "best_of"):  # more rows than --max-running-requests
        with pytest.raises(APIError) as exc_info:
            decoding(_parse(**{name: "5"}), ServerConfig(), max_rows=4)
        assert exc_info.value.status == 400 and exc_info.value.param == name
    assert decoding(_parse(beam_size="4"), ServerConfig(), max_rows=4)["beam_size"] == 4


def test_server_config_beam_defaults_and_flags():
    assert (ServerConfig().beam_size, ServerConfig().best_of) == (1, 1)  # fast by default
    assert server_config.MAX_GROUP_ROWS == MAX_GROUP_ROWS
    args = build_parser().parse_args(["serve", "--beam-size", "5", "--best-of", "3"])
    assert config_from_args(args, ServerConfig).beam_size == 5
    for bad in (dict(beam_size=0), dict(best_of=17), dict(beam_size=True)):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


@pytest.mark.parametrize("raw", ["0", "17", "abc", "2.5"])
def test_serve_bad_beam_size_exits_2(raw, capsys):
    from edserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--beam-size", raw])
    assert exit_info.value.code == 2
    assert "--beam-size" in capsys.readouterr().err


def test_serve_beam_size_over_rows_exits_2(capsys):
    from edserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--beam-size", "5", "--max-running-requests", "4"])
    assert exit_info.value.code == 2
    assert "--max-running-requests >= 5" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
@pytest.mark.parametrize("name,raw", [(n, v) for n, vs in BAD.items() for v in vs[:4]])
def test_bad_fields_400(http, path, name, raw):
    _assert_400(_post(http, path, **{name: raw}), name)


def test_patience_needs_beam_search_400(http):
    _assert_400(_post(http, patience="2"), "patience")
    _assert_400(_post(http, beam_size="1", patience="2"), "patience")


def test_beam_size_5_transcribes_jfk(http):
    r = _post(http, beam_size="5")
    assert r.status_code == 200, r.text
    assert r.json()["text"] == TINY_EN_TEXT
    r = _post(http, beam_size="5", patience="2", length_penalty="1",
              response_format="verbose_json")
    assert r.status_code == 200, r.text
    body = r.json()  # timestamp tokens + another ranking: punctuation may differ
    assert _words(body["text"]) == _words(TINY_EN_TEXT) and body["segments"]
    _settled(http)


def test_beam_best_of_and_greedy_requests_batch_together(http):
    """Concurrent beam, greedy and best_of (sampling) requests all finish; the KV is freed."""
    cases = [dict(beam_size="5"), dict(), dict(beam_size="3", response_format="srt"),
             dict(temperature="0.4", best_of="4"), dict(beam_size="16")]
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda f: _post(http, **f), cases))
    for fields, r in zip(cases, responses, strict=True):
        assert r.status_code == 200, (fields, r.text)
    assert responses[0].json()["text"] == TINY_EN_TEXT
    assert responses[1].json()["text"] == TINY_EN_TEXT
    assert "ask what you can do for your country" in responses[2].text
    assert "your country" in responses[3].json()["text"]
    _settled(http)


def test_openai_client_extra_body(client):
    """The ``openai`` client sends the fields through ``extra_body`` (multipart fields)."""
    import openai

    result = client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", JFK),
                                                extra_body={"beam_size": 4, "best_of": 2})
    assert result.text == TINY_EN_TEXT
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", JFK),
                                           extra_body={"beam_size": 0})
    assert exc_info.value.body["param"] == "beam_size"
