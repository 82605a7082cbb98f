"""Every bad input gets the documented status and OpenAI's error shape; the server keeps
serving correctly and the KV cache stays consistent afterwards."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from .server_helpers import API_KEY, DATA, MAX_AUDIO_SECONDS, MAX_UPLOAD_MB, integrity, wav_bytes

JFK = ("And so my fellow Americans ask not what your country can do for you, ask what you can "
       "do for your country.")
GOOD = (DATA / "jfk.wav").read_bytes()


def _post(http: httpx.Client, files=None, data=None, path="/v1/audio/transcriptions",
          headers=None) -> httpx.Response:
    fields = {"model": "whisper-1"} if data is None else data
    return http.post(path, files=files, data=fields, headers=headers)


def _assert_error(r: httpx.Response, status: int, param: str | None = None,
                  code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


CORRUPT = GOOD[:44] + bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8))
BAD_FILES = {
    "empty": (b"", "empty_file"),
    "not_audio": (b"%PDF-1.4 this is not audio at all\n" * 50, "invalid_audio"),
    "truncated_header": (GOOD[:30], "invalid_audio"),
    "corrupt_mp3": (b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\xff" * 500, None),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_undecodable_files_400(http, name):
    content, code = BAD_FILES[name]
    r = _post(http, files={"file": (f"{name}.wav", content)})
    _assert_error(r, 400, "file", code)


def test_corrupt_payload_is_error_or_transcribed(http):
    """A valid WAV header with random bytes decodes as noise: 200 (any text) or a 400."""
    r = _post(http, files={"file": ("noise.wav", CORRUPT)})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        _assert_error(r, 400, "file")


def test_silence_is_empty_text_not_error(client):
    silent = wav_bytes(np.zeros(16000 * 5, dtype=np.float32))
    result = client.audio.transcriptions.create(model="whisper-1", file=("s.wav", silent))
    assert len(result.text) < 20


def test_over_long_audio_400(http):
    audio = np.zeros(int(16000 * (MAX_AUDIO_SECONDS + 5)), dtype=np.float32)
    r = _post(http, files={"file": ("long.wav", wav_bytes(audio))})
    _assert_error(r, 400, "file", "audio_too_long")


@pytest.mark.parametrize("chunked", [False, True])
def test_over_large_upload_413(http, chunked):
    size = int((MAX_UPLOAD_MB + 1.5) * 2**20)
    big = GOOD + b"\0" * (size - len(GOOD))
    if not chunked:
        r = _post(http, files={"file": ("big.wav", big)})
        _assert_error(r, 413, "file", "file_too_large")
        return
    boundary = "xxBOUNDARYxx"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1"
            f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"big.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def body():  # a generator: httpx sends it chunked, without Content-Length
        yield head
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
        yield tail

    r = http.post("/v1/audio/transcriptions", content=body(),
                  headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    _assert_error(r, 413, "file", "file_too_large")


@pytest.mark.parametrize("field,value,param", [
    ("response_format", "xml", "response_format"),
    ("temperature", "1.5", "temperature"),
    ("temperature", "-0.1", "temperature"),
    ("temperature", "hot", "temperature"),
    ("temperature", "nan", "temperature"),
    ("stream", "maybe", "stream"),
    ("timestamp_granularities[]", "sentence", "timestamp_granularities[]"),
    ("language", "de", "language"),
])
def test_invalid_fields_400(http, field, value, param):
    r = _post(http, files={"file": ("jfk.wav", GOOD)}, data={"model": "whisper-1", field: value})
    _assert_error(r, 400, param)


@pytest.mark.parametrize("fmt", ["json", "text", "srt", "vtt"])
def test_granularities_need_verbose_json(http, fmt):
    """As OpenAI's API: ``timestamp_granularities[]`` with another format is refused, not
    ignored (nor computed and dropped: word timestamps cost an alignment pass)."""
    r = _post(http, files={"file": ("jfk.wav", GOOD)},
              data={"model": "whisper-1", "response_format": fmt,
                    "timestamp_granularities[]": "word"})
    _assert_error(r, 400, "timestamp_granularities[]", "invalid_value")
    assert "verbose_json" in r.json()["error"]["message"]


def test_repeated_fields_400(http):
    """A field given twice is refused by name, not resolved by keeping one of the values."""
    two_files = [("file", ("a.wav", GOOD)), ("file", ("b.wav", GOOD))]
    _assert_error(_post(http, files=two_files), 400, "file", "duplicate_field")
    r = _post(http, files={"file": ("jfk.wav", GOOD)},
              data={"model": "whisper-1", "language": ["en", "fr"]})
    _assert_error(r, 400, "language", "duplicate_field")
    assert "2 times" in r.json()["error"]["message"]
    r = _post(http, files={"file": ("jfk.wav", GOOD)}, data={"model": "whisper-1",
                                                              "language": "en"})
    assert r.status_code == 200, r.text  # once is fine


def test_missing_file_and_model(http):
    _assert_error(_post(http, data={"model": "whisper-1"}), 400, "file",
                  "missing_required_parameter")
    _assert_error(_post(http, files={"file": ("jfk.wav", GOOD)}, data={}), 400, "model")
    _assert_error(_post(http, data={"model": "whisper-1", "file": "not a file"}), 400, "file")
    _assert_error(_post(http, files={"file": ("jfk.wav", GOOD)}, data={"model": "gpt-9"}), 404,
                  "model", "model_not_found")
    r = http.post("/v1/audio/transcriptions", content=b'{"file": 1}',
                  headers={"Content-Type": "application/json"})
    _assert_error(r, 400, "file")


def test_translation_on_english_only_model_400(http, client):
    r = _post(http, files={"file": ("jfk.wav", GOOD)}, path="/v1/audio/translations")
    _assert_error(r, 400, "model", "unsupported_task")
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.translations.create(model="whisper-1", file=("jfk.wav", GOOD))


def test_auth(base_url, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        with httpx.Client(base_url=base_url, timeout=60, headers=headers) as anon:
            r = anon.post("/v1/audio/transcriptions", files={"file": ("jfk.wav", GOOD)},
                          data={"model": "whisper-1"})
            _assert_error(r, 401, None, "invalid_api_key")
            _assert_error(anon.get("/v1/models"), 401)
            assert anon.get("/health").status_code == 200
    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", GOOD))


def test_unknown_route_shape(http):
    _assert_error(http.get("/v1/nope"), 404)
    _assert_error(http.get("/v1/audio/transcriptions"), 405)


def test_still_serving_after_bad_inputs(client, http):
    """Runs last in this module: the engine is intact and still transcribes correctly."""
    integrity(http)
    assert client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", GOOD)).text \
        == JFK
    integrity(http)
