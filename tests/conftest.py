"""Shared test setup: Triton kernels run under the CPU interpreter when there is no GPU, and
the KV allocators validate every call (``EDSERVE_DEBUG_CHECKS=1``, off in production), and
every engine a test builds must end the test idle and pass the KV integrity check.

``EDSERVE_TEST_THREADS`` sets torch's CPU threads (default: up to 4, the cores shared among
``pytest -n`` workers); on a loaded machine, 1 avoids thread oversubscription stalls.
"""

import os
import weakref

os.environ.setdefault("EDSERVE_DEBUG_CHECKS", "1")  # allocators validate every call in tests
# Engines never compile their decode step behind a test's back (tests/engine/test_cpu_compile.py
# asks for it explicitly): a long test would otherwise pay the compile once past the threshold.
os.environ.setdefault("EDSERVE_CPU_COMPILE", "off")
# ``--dtype auto`` on CPU is bfloat16 where the CPU has native bf16 (AVX512_BF16, AMX): the
# oracles (HF, openai-whisper, float64 references) compare in float32 on every machine.
# tests/engine/test_cpu_modes.py checks the machine's own choice with this unset.
os.environ.setdefault("EDSERVE_CPU_AUTO_DTYPE", "float32")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from edserve.engine.engine import Engine  # noqa: E402

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest -n N shares the cores
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_threads = int(os.environ.get("EDSERVE_TEST_THREADS", "0")) or max(
    1, min(4, (_cores or 1) // _workers))
torch.set_num_threads(_threads)
# engines keep the test thread count; an xdist worker inherits the controller's value, which
# counted one process (2 threads per worker on 2 cores: oversubscribed, several times slower)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["EDSERVE_THREADS"] = str(_threads)
else:
    os.environ.setdefault("EDSERVE_THREADS", str(_threads))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``pytest -n auto``: one worker per usable core (the affinity mask, not the host's count),
    at most one per 3 GiB of memory (a worker holds torch, models and live servers) and 8."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(_cores or 1, int(mem_gib // 3), 8))


# The slowest test modules on 2 CPU workers, slowest first (measured single-threaded; this only
# orders the run, a module missing here just runs in collection order after them).
SLOW_MODULES = (
    "whisper/test_beam_reference.py",
    "integrations/test_ray_serve.py",
    "whisper/test_openai_parity.py",
    "whisper/test_beam_faster_whisper.py",
    "dp/test_dp_server.py",
    "whisper/test_language.py",
    "test_batch_cli.py",
    "whisper/test_fallback_reuse.py",
    "engine/test_cpu_modes.py",
    "server/test_load.py",
    "bench/test_soak.py",
    "engine/test_overlap.py",
    "parallel/test_tp_engine.py",
    "engine/test_mixed_steps.py",
    "engine/test_cpu_compile.py",
    "models/mllama/test_engine.py",
    "server/test_openapi_fuzz.py",
    "dp/test_dp_shutdown.py",
)


def pytest_collection_modifyitems(config, items):
    """The slow modules first (a stable sort: every module stays in one piece, in order)."""
    here = os.path.dirname(__file__)
    rank = {os.path.join(here, m): i for i, m in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n``: whole modules to a worker (``--dist loadfile``), so each module-scoped
    fixture (engines, oracles, converted models) is built once instead of on every worker
    that runs one of its tests; modules go out in collection order (the slow ones first,
    above) so that no long module starts last while the other workers idle. Another ``--dist``
    given on the command line is kept."""
    from xdist.scheduler import LoadFileScheduling

    if config.option.dist != "load":  # -n's default
        return None
    config.option.loadscopereorder = False  # keep the order above (not by test count)
    return LoadFileScheduling(config, log)


@pytest.fixture(scope="session")
def random_whisper(tmp_path_factory):
    """A small random-weight Whisper HF folder (the tiny.en tokenizer): runs where the embedded
    model's package is not installed (the H200 image)."""
    from whisper_fixtures import make_random_whisper

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
