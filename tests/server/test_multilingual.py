"""Whisper base behind the server: translation (every response format) and the detected
language in verbose_json, through the official ``openai`` client."""

from __future__ import annotations

import re

import httpx
import pytest

from edserve.config import EngineConfig
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

from .server_helpers import API_KEY, DATA


@pytest.fixture(scope="module")
def base_client():
    import openai

    aengine, app = build(EngineConfig(model="base", device="cpu", max_running_requests=4),
                         ServerConfig(api_key=API_KEY))
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                           timeout=300) as client:
            yield client
    finally:
        server.stop()
        aengine.shutdown()


def _translate(client, fmt: str):
    with open(DATA / "espeak_es.wav", "rb") as f:
        return client.audio.translations.create(model="whisper-1", file=f, response_format=fmt)


@pytest.mark.parametrize("fmt", ["json", "text", "srt", "vtt", "verbose_json"])
def test_translation_is_english_in_every_format(base_client, fmt):
    result = _translate(base_client, fmt)
    text = result if isinstance(result, str) else result.text
    assert "good morning" in text.lower() and "buenos" not in text.lower(), text
    if fmt == "verbose_json":
        assert result.task == "translate" and result.language == "spanish"
        assert result.segments and result.segments[0].end > result.segments[0].start


def _guesses(client) -> dict[str, float]:
    """``edserve_language_guesses_total`` by result, from the server's /metrics."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    text = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).text
    found = dict(re.findall(r'^edserve_language_guesses_total\{result="(\w+)"\} (\S+)$', text,
                            re.M))
    return {k: float(v) for k, v in found.items()}


def test_transcription_reports_the_detected_language(base_client):
    """The detected language in verbose_json; each detecting window's guess is counted on
    /metrics (jfk then the German clip: the second guesses English, detected by the first,
    and is wrong)."""
    before = _guesses(base_client)
    assert set(before) == {"right", "wrong"}
    with open(DATA / "jfk.wav", "rb") as f:
        result = base_client.audio.transcriptions.create(model="whisper-1", file=f,
                                                         response_format="verbose_json")
    assert result.language == "english"
    assert result.text.startswith("And so my fellow Americans, ask not what your country")
    with open(DATA / "espeak_de.wav", "rb") as f:
        result = base_client.audio.transcriptions.create(model="whisper-1", file=f,
                                                         response_format="verbose_json")
    assert result.language == "german" and result.text.startswith("Guten Morgen")
    after = _guesses(base_client)
    assert after["right"] + after["wrong"] == before["right"] + before["wrong"] + 2
    assert after["wrong"] >= before["wrong"] + 1
