"""The README's Python examples run as written: each ```python block is executed; the two that
talk to a server get a live one (port and file names substituted, nothing else)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from edserve.config import EngineConfig
from edserve.server.config import ServerConfig
from edserve.server.launch import ServerThread, build

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(),
                    re.S | re.M)


def _block(marker: str) -> str:
    [code] = [b for b in BLOCKS if marker in b]
    return code


def test_every_python_block_is_covered():
    covered = [b for b in BLOCKS if b.startswith("import edserve")
               or b.startswith("import torch") or "openai.OpenAI" in b]
    assert len(BLOCKS) >= 5 and covered == BLOCKS


@pytest.mark.parametrize("marker", ["edserve.Whisper()", "edserve.build_engine("])
def test_python_api_blocks(marker, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(_block(marker), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if marker == "edserve.Whisper()":
        assert "ask not what your country can do for you" in out and "[0.00 ->" in out


def _serve(engine_config: EngineConfig, server_config: ServerConfig):
    aengine, app = build(engine_config, server_config)
    return aengine, ServerThread(app, "127.0.0.1", 0).start()


def test_transcription_client_block(tmp_path, monkeypatch, capsys):
    pytest.importorskip("openai")
    aengine, srv = _serve(EngineConfig(device="cpu", max_running_requests=4),
                          ServerConfig(api_key="sk-local"))
    try:
        shutil.copy(ROOT / "tests" / "data" / "jfk.wav", tmp_path / "talk.mp3")
        monkeypatch.chdir(tmp_path)
        code = _block("client.audio.transcriptions").replace("http://127.0.0.1:8000",
                                                             srv.url)
        exec(compile(code, "README.md", "exec"), {})
    finally:
        srv.stop()
        aengine.shutdown()
    out = capsys.readouterr().out
    assert "ask not what your country" in out and "transcript.text.done" in out


def test_chat_client_block(tmp_path, monkeypatch, capsys):
    pytest.importorskip("openai")
    pytest.importorskip("transformers")
    from tests.models.mllama.chat_tiny import save_chat_model
    from tests.models.mllama.hf_tiny import synthetic_image

    folder = save_chat_model(tmp_path / "mllama")
    synthetic_image(80, 60).save(tmp_path / "cat.png")
    aengine, srv = _serve(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                       context_length=256, max_running_requests=2),
                          ServerConfig(served_model_name="llama-vision"))
    try:
        monkeypatch.chdir(tmp_path)
        code = _block("What is in the image?").replace("http://127.0.0.1:8000", srv.url)
        exec(compile(code, "README.md", "exec"), {})
    finally:
        srv.stop()
        aengine.shutdown()
    assert "completion_tokens" in capsys.readouterr().out


def test_tools_and_json_block(tmp_path, monkeypatch, capsys):
    """On the tiny random Mllama with a byte-level tokenizer; compact JSON, so the random
    weights cannot pad the forced call and the schema's answer with whitespace."""
    pytest.importorskip("openai")
    pytest.importorskip("transformers")
    pytest.importorskip("llguidance")
    import ast
    import json

    from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer
    from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny

    folder = tmp_path / "mllama"
    save_hf_tiny(build_hf_tiny(), folder)
    save_byte_chat_tokenizer(folder)
    aengine, srv = _serve(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                       context_length=1024, max_running_requests=2),
                          ServerConfig(served_model_name="llama-vision", json_whitespace=False))
    try:
        code = _block("tool_choice").replace("http://127.0.0.1:8000", srv.url)
        exec(compile(code, "README.md", "exec"), {})
    finally:
        srv.stop()
        aengine.shutdown()
    calls, same, answer = capsys.readouterr().out.splitlines()[-3:]
    calls = ast.literal_eval(calls)  # one or more: required, parallel calls
    assert calls and all(name == "get_weather" and json.loads(args)["city"] in ("Oslo", "Paris")
                         for name, args in calls)
    assert same == "True"  # the streamed pieces add up to each call's arguments
    assert isinstance(json.loads(answer)["sum"], int)
