"""``--engine-process`` resolved by the server's launcher: as given, else on only for a
Whisper model on one CUDA device."""

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
