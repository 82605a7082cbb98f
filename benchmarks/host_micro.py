"""Host-path micro-measurements of issue 18: filter construction per transcription task, and
cross-thread calls per ``AsyncEngine.generate`` of one window (embedded tiny.en, one thread).

  PYTHONPATH=<checkout> python benchmarks/host_micro.py   # run on two checkouts to compare
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from edserve.audio.decode import load_audio
from edserve.engine.async_engine import AsyncEngine
from edserve.engine.engine import Engine
from edserve.runtime import build_engine
from edserve.whisper.logits import SuppressBlank, SuppressTokens, default_suppress_tokens
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task

JFK = Path(__file__).resolve().parent.parent / "tests" / "data" / "jfk.wav"


def filters_ms(tok, n: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(n):
        SuppressBlank.of(tok)
        SuppressTokens.of(default_suppress_tokens(tok))
    return (time.perf_counter() - t) / n * 1000


async def cross_thread_calls(aengine: AsyncEngine, engine: Engine) -> tuple[int, int]:
    loop = asyncio.get_running_loop()
    original, calls = loop.call_soon_threadsafe, [0]

    def counting(*args, **kw):
        calls[0] += 1
        return original(*args, **kw)

    loop.call_soon_threadsafe = counting
    req = make_task(engine, load_audio(JFK), TranscribeOptions()).next_request()
    out = await aengine.generate(req)
    return calls[0], len(out.token_ids)


def main() -> None:
    engine = build_engine(threads=1, max_running_requests=4)
    print(f"filters per task: {filters_ms(engine.tokenizer):.3f} ms")
    aengine = AsyncEngine(engine).start()
    try:
        calls, n = asyncio.run(cross_thread_calls(aengine, engine))
    finally:
        aengine.shutdown()
    print(f"cross-thread calls for one generate of {n} tokens: {calls}")


if __name__ == "__main__":
    main()
