"""Shared fixtures: the tiny HF Mllama (oracle) and its saved folder."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def hf_tiny():
    from tests.models.mllama.hf_tiny import build_hf_tiny
    return build_hf_tiny()


@pytest.fixture(scope="session")
def tiny_folder(hf_tiny, tmp_path_factory):
    from tests.models.mllama.hf_tiny import save_hf_tiny
    return save_hf_tiny(hf_tiny, tmp_path_factory.mktemp("tiny_mllama"))
