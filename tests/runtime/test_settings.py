"""Machine-dependent ``auto`` settings resolved once (``edserve.runtime.settings``)."""

from __future__ import annotations

import torch

from edserve.config import EngineConfig
from edserve.runtime import build_engine
from edserve.runtime.settings import RuntimeSettings, use_device_beams


def _settings(device: str) -> RuntimeSettings:
    return RuntimeSettings(torch.device(device), torch.float32, None, "torch", 16, torch.float32)


def test_device_beams_default_on_where_steps_overlap():
    cuda, cpu = _settings("cuda"), _settings("cpu")
    assert use_device_beams(EngineConfig(), cuda) is True
    assert use_device_beams(EngineConfig(), cpu) is False
    assert use_device_beams(EngineConfig(overlap_schedule="off"), cuda) is False
    assert use_device_beams(EngineConfig(tensor_parallel_size=2, cuda_graph=False), cuda) is False
    assert use_device_beams(EngineConfig(beam_on_device=False), cuda) is False
    assert use_device_beams(EngineConfig(beam_on_device=True), cpu) is True


def test_engine_carries_the_resolved_choice():
    assert build_engine(model="tiny.en", device="cpu").config.beam_on_device is False
    assert build_engine(model="tiny.en", device="cpu",
                        beam_on_device=True).config.beam_on_device is True
