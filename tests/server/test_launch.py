"""The server's launcher: ``--engine-process`` resolved (as given, else on only for a
Whisper model on one CUDA device), ``--served-model-name`` resolved (as given, else whisper-1
for Whisper and the ``--model`` value for others) and the HTTP parser chosen by ``--http``."""

from __future__ import annotations

import json

import pytest
import torch

import edserve.server.launch as launch
from edserve.config import EngineConfig
from edserve.models.weights import model_type_of
from edserve.server.config import ServerConfig


@pytest.fixture
def mllama_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mllama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_model_type_without_reading_weights(mllama_folder, tmp_path_factory):
    assert model_type_of(None) == "whisper"  # the embedded CTranslate2 tiny.en
    assert model_type_of(mllama_folder) == "mllama"
    assert model_type_of(tmp_path_factory.mktemp("empty")) is None


def test_served_model_name_default_follows_the_model(mllama_folder):
    named = launch.with_model_name
    assert named(EngineConfig(), ServerConfig()).served_model_name == "whisper-1"
    mllama = EngineConfig(model=str(mllama_folder))
    assert named(mllama, ServerConfig()).served_model_name == str(mllama_folder)  # as vLLM
    given = ServerConfig(served_model_name="llama-vision")
    assert named(mllama, given) is given and named(EngineConfig(), given) is given


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_is_on_for_whisper_on_one_cuda_device(monkeypatch, device, mllama_folder):
    monkeypatch.setattr(launch, "resolve_device", lambda name: torch.device(device))
    cuda = device == "cuda"
    assert launch.engine_process(EngineConfig(), ServerConfig()) is cuda
    assert launch.engine_process(EngineConfig(model=str(mllama_folder)), ServerConfig()) is False
    tp = EngineConfig(tensor_parallel_size=2, cuda_graph=False)
    assert launch.engine_process(tp, ServerConfig()) is False
    for given in (True, False):  # as given, whatever the machine
        assert launch.engine_process(EngineConfig(), ServerConfig(engine_process=given)) is given


def test_http_parser_choice(monkeypatch):
    """``--http``: httptools (C) when installed under ``auto``, h11 on request, both guarded
    with the configured limits; a missing or unknown parser is a start-up error."""
    import uvicorn.protocols.http.h11_impl as h11_impl
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    import edserve.server.connections as conn

    auto = launch.uvicorn_options(ServerConfig(header_timeout=3.0))["http"]
    assert issubclass(auto, httptools_impl.HttpToolsProtocol)
    assert issubclass(auto, conn.ConnectionGuard) and auto.header_timeout == 3.0
    h11 = conn.guarded_protocol(2.0, 16, "h11")
    assert issubclass(h11, h11_impl.H11Protocol) and h11.max_connections == 16
    with pytest.raises(ValueError, match="--http must be one of"):
        conn.guarded_protocol(2.0, 16, "h2")
    monkeypatch.setattr(conn, "GuardedHttpToolsProtocol", None)
    assert issubclass(conn.guarded_protocol(2.0, 16, "auto"), h11_impl.H11Protocol)
    with pytest.raises(ValueError, match="httptools package is not installed"):
        conn.guarded_protocol(2.0, 16, "httptools")
