"""The ``mel_padding`` form field (transcriptions and translations) and ``--mel-padding``:
validated (400 naming the field), defaulted from the server config, and decoded with the
layout it names (the same text as the in-process API with that layout)."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest
from starlette.datastructures import FormData, UploadFile

from edserve.audio.decode import load_audio
from edserve.cli import build_parser
from edserve.config_args import config_from_args
from edserve.server.config import ServerConfig
from edserve.server.errors import APIError
from edserve.server.params import parse_form
from edserve.server.transcription import build_options
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

from .server_helpers import DATA, integrity

WAV = DATA / "cards_005.wav"  # tiny.en greedy: "Eight of spades, ..." silence, "8 of ..." zeros


def _parse(**fields: str):
    form = FormData([("model", "whisper-1"), *fields.items(),
                     ("file", UploadFile(io.BytesIO(b"RIFF"), filename="a.wav"))])
    return asyncio.run(parse_form(form, 1.0))


def test_form_field_values_and_server_default():
    assert _parse().mel_padding is None and _parse(mel_padding=" ").mel_padding is None
    assert _parse(mel_padding="zeros").mel_padding == "zeros"
    assert build_options(_parse(), "transcribe", ServerConfig(), 0).mel_padding == "silence"
    cfg = ServerConfig(mel_padding="zeros")
    assert build_options(_parse(), "transcribe", cfg, 0).mel_padding == "zeros"
    assert build_options(_parse(mel_padding="silence"), "transcribe", cfg, 0).mel_padding \
        == "silence"
    for bad in ("Zeros", "none", "x" * 200):
        with pytest.raises(APIError) as exc_info:
            _parse(mel_padding=bad)
        assert exc_info.value.status == 400 and exc_info.value.param == "mel_padding"
        assert len(str(exc_info.value)) < 200  # a long value is cut in the message


def test_server_flag(capsys):
    args = build_parser().parse_args(["serve", "--mel-padding", "zeros"])
    assert config_from_args(args, ServerConfig).mel_padding == "zeros"
    with pytest.raises(ValueError, match="'mel_padding' must be one of silence, zeros"):
        ServerConfig(mel_padding="pad")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--mel-padding", "pad"])
    assert exit_info.value.code == 2 and "--mel-padding" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_bad_value_400_names_the_field(http: httpx.Client, path):
    r = http.post(path, files={"file": ("a.wav", WAV.read_bytes())},
                  data={"model": "whisper-1", "mel_padding": "reflect"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "mel_padding" and err["type"] == "invalid_request_error"
    assert "'mel_padding' must be one of silence, zeros; got 'reflect'" == err["message"]


def test_each_layout_decodes_as_in_process(http: httpx.Client):
    """The server (tiny.en) with each layout gives the in-process text with that layout."""
    from edserve.runtime import build_engine

    local = build_engine(device="cpu", max_running_requests=1)
    expected = {p: transcribe(local, [load_audio(WAV)], options=TranscribeOptions(
        mel_padding=p))[0].text for p in ("silence", "zeros")}
    assert expected["silence"] != expected["zeros"]  # the clip tells the layouts apart
    for padding, text in expected.items():
        r = http.post("/v1/audio/transcriptions", files={"file": ("a.wav", WAV.read_bytes())},
                      data={"model": "whisper-1", "mel_padding": padding})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == text, padding
    integrity(http)
