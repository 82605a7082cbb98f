"""Single-engine reference texts (one in-process tiny.en engine, computed once per session)
for the data-parallel, Ray Serve and batch CLI tests."""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path

DATA = Path(__file__).parent.parent / "data"
CLIPS = ("jfk", "librivox_0870", "cards_005")


@functools.lru_cache(maxsize=1)
def single_engine_texts() -> dict[str, str]:
    """clip name -> the text one engine gives (``edserve transcribe``'s path)."""
    from edserve.runtime import build_engine
    from edserve.whisper.transcribe import transcribe

    results = transcribe(build_engine(), [str(DATA / f"{c}.wav") for c in CLIPS])
    return {c: r.text for c, r in zip(CLIPS, results, strict=True)}


def metric(body: str, name: str, worker: int) -> float:
    """The value of ``name{worker="<worker>"}`` in a Prometheus text body."""
    m = re.search(rf'^{name}{{worker="{worker}"}} (\S+)$', body, re.M)
    assert m, f"{name} for worker {worker} missing"
    return float(m.group(1))


def wait_for(predicate, timeout: float, what: str, step: float = 0.1):
    """Poll ``predicate()`` until it is truthy (returns it) or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
