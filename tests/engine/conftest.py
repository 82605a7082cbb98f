import weakref

import pytest
from whisper_fixtures import make_random_whisper

from edserve.engine.engine import Engine


@pytest.fixture(scope="session")
def random_whisper(tmp_path_factory):
    return make_random_whisper(tmp_path_factory.mktemp("rand_whisper"))


@pytest.fixture(autouse=True)
def engines_stay_intact(monkeypatch):
    """After every engine test: each engine it built is idle and passes the integrity check."""
    created: list[weakref.ref] = []
    original = Engine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(weakref.ref(self))

    monkeypatch.setattr(Engine, "__init__", tracking_init)
    yield
    for ref in created:
        engine = ref()
        if engine is None:
            continue
        assert not engine.has_work(), "engine test left requests behind"
        engine.check_integrity()
        alloc = engine.pools.allocator
        assert alloc.available_size() == alloc.size, "KV slots leaked"
        assert engine.pools.req_to_token_pool.available_size() == \
            engine.pools.req_to_token_pool.size, "rows leaked"
