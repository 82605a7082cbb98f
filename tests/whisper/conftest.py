import pytest

from edserve.models.weights import default_model_folder
from edserve.tokenizer import WhisperTokenizer


@pytest.fixture(scope="session")
def tok() -> WhisperTokenizer:
    """tiny.en's tokenizer (no model weights loaded)."""
    return WhisperTokenizer.from_file(default_model_folder() / "tokenizer.json", 51864)
