import pytest
from whisper_fixtures import make_random_whisper


@pytest.fixture(scope="session")
def random_whisper(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("rand_whisper"))
