"""Where the GPU waits for the host: GPU-idle time attributed to what the engine thread was doing.

A sampling thread reads the engine thread's Python stack every ``--interval-us`` (the deepest
``edserve`` frame, file:line and function) while the torch profiler records the device's
kernels and copies; every sample that falls outside all device activity counts as idle time
of its frame. The table lists frames by idle ms: the host work that kept the device waiting.
Scenarios (large-v3 random bf16 weights, flat/128 unless ``--config``, filters on):

  arrivals   256 requests x 17 tokens, 32 closed-loop callers (``arrivals_gpu.py``'s driver)
  prefill16  one step admitting 16 clips into an idle engine, then its drain (``prefill_gpu``)
  decode64   30 decode steps of 64 running rows
  decode1    30 decode steps of one running row (the single-client latency)
  beam64     30 decode steps of 64 requests x beam 5, beams chosen on the device
             (``beam_gpu.py``'s engine)
  serve      the server in this process (``edserve serve``'s app, 64 rows, 17-token windows,
             fallback off) driven by ``edserve bench`` in a subprocess: 256 x jfk.wav at 32
             clients; the engine thread is sampled, and the API thread in a second table

  python benchmarks/gpu_idle.py --scenarios arrivals prefill16 decode64
  python benchmarks/gpu_idle.py --scenarios beam64 decode64 --cprofile 30   # host time by function
  python benchmarks/gpu_idle.py --dry-run     # toy model on CPU: the script runs
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import sys
import threading
import time
import traceback
import warnings

import torch
import whisper_gpu as wg
from arrivals_gpu import callers, device_and_dtype, requests
from torch.profiler import ProfilerActivity, profile, record_function

from edserve.engine.request import GenerateRequest, SamplingParams


class StackSampler(threading.Thread):
    """Samples one thread's deepest ``edserve`` frame every ``interval`` seconds:
    ``samples`` holds ``(perf_counter_ns, label)``."""

    def __init__(self, thread_id: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.tid, self.interval, self.samples = thread_id, interval, []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            time.sleep(self.interval)
            frame = sys._current_frames().get(self.tid)
            label = "(outside edserve)" if frame is None else \
                f"(outside) {frame.f_code.co_filename.rsplit('/', 1)[-1]} {frame.f_code.co_name}"
            while frame is not None:
                name = frame.f_code.co_filename
                if "/edserve/" in name:
                    label = (f"{name.rsplit('/edserve/', 1)[1]}:{frame.f_lineno} "
                             f"{frame.f_code.co_name}")
                    break
                frame = frame.f_back
            self.samples.append((time.perf_counter_ns(), label))


def busy_spans(prof) -> list[tuple[float, float]]:
    """Union of the device's kernel/copy intervals (profiler microseconds), sorted."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA")
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def thread_id(name: str | None) -> int:
    """The ident of the live thread called ``name`` (None: this thread)."""
    if name is None:
        return threading.get_ident()
    return next(t.ident for t in threading.enumerate() if t.name == name)


def _steps(engine) -> int:
    """Engine steps taken so far (every kind)."""
    return sum(t.steps for t in engine.step_counters.snapshot().values())


def idle_by_frame(fn, dev: str, interval_us: float, rows: int, label: str,
                  threads: tuple[str | None, ...] = (None,), engine=None) -> None:
    """Runs ``fn`` once under the profiler and one stack sampler per thread (by name; None:
    this thread); prints wall, device-busy share, the engine's steps and host<->device syncs
    per step (``torch.cuda.set_sync_debug_mode``, any thread) and, per thread, the frames it
    was in while the device was idle."""
    steps0 = None if engine is None else _steps(engine)
    where: collections.Counter = collections.Counter()

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        # runs in the thread that warned: name it and its deepest edserve frame (warnings
        # other than the sync debug mode's are counted apart)
        kind = "" if "synchroniz" in str(message) else f"[not a sync: {category.__name__}] "
        frames = [f for f in traceback.extract_stack()[:-1] if "/edserve/" in f.filename]
        at = (f"{frames[-1].filename.rsplit('/edserve/', 1)[1]}:{frames[-1].lineno}"
              if frames else f"{filename.rsplit('/', 1)[-1]}:{lineno}")
        where[f"{kind}{threading.current_thread().name} {at}"] += 1

    with contextlib.ExitStack() as syncs:
        if dev == "cuda":
            syncs.enter_context(warnings.catch_warnings())
            warnings.simplefilter("always")
            warnings.showwarning = seen
            torch.cuda.set_sync_debug_mode("warn")
            syncs.callback(torch.cuda.set_sync_debug_mode, 0)
        _idle_by_frame(fn, dev, interval_us, rows, label, threads)
    if steps0 is not None:
        steps = _steps(engine) - steps0
        n = sum(v for k, v in where.items() if not k.startswith("[not a sync"))
        print(f"\n{label}: {steps} engine steps, {n / max(steps, 1):.2f} host<->device syncs "
              f"per step ({', '.join(f'{k} x{v}' for k, v in where.most_common(4)) or 'none'})")


def _idle_by_frame(fn, dev: str, interval_us: float, rows: int, label: str,
                   threads: tuple[str | None, ...]) -> None:
    wg.sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, interval_us / 2e6))  # let the sampler in on time
    samplers = [StackSampler(thread_id(t), interval_us / 1e6) for t in threads]
    try:
        with profile(activities=acts) as prof:
            with record_function("gpu_idle.t0"):
                t0_ns = time.perf_counter_ns()
            for sampler in samplers:
                sampler.start()
            fn()
            wg.sync(dev)
            for sampler in samplers:
                sampler.stop.set()
                sampler.join()
            t1_ns = time.perf_counter_ns()
    finally:
        sys.setswitchinterval(old)
    marker = next(e for e in prof.events() if e.name == "gpu_idle.t0")
    base = marker.time_range.start  # profiler us at t0_ns
    spans = busy_spans(prof)
    starts = [s for s, _ in spans]

    def busy(ns: int) -> bool:
        us = base + (ns - t0_ns) / 1e3
        i = bisect.bisect_right(starts, us) - 1
        return i >= 0 and spans[i][1] >= us

    wall = (t1_ns - t0_ns) / 1e6
    busy_ms = sum(e - s for s, e in spans) / 1e3
    print(f"\n## {label}: wall {wall:.1f} ms (profiled), device busy {busy_ms:.1f} ms "
          f"({100 * busy_ms / wall:.0f} %), idle {wall - busy_ms:.1f} ms")
    for name, sampler in zip(threads, samplers, strict=True):
        idle: collections.Counter = collections.Counter()
        allt: collections.Counter = collections.Counter()
        prev = t0_ns
        for ns, frame in sampler.samples:
            dt = (ns - prev) / 1e6
            prev = ns
            allt[frame] += dt
            if not busy(ns):
                idle[frame] += dt
        print(f"\nthread {name or 'main'}: {len(sampler.samples)} samples")
        print("| frame | idle ms | share of idle | all ms |\n|---|---:|---:|---:|")
        total_idle = sum(idle.values()) or 1.0
        for frame, ms in idle.most_common(rows):
            print(f"| `{frame}` | {ms:.1f} | {100 * ms / total_idle:.0f} % | "
                  f"{allt[frame]:.1f} |")
        print("| **by all time** | | | |")
        for frame, ms in allt.most_common(rows):
            print(f"| `{frame}` | {idle[frame]:.1f} | | {ms:.1f} |")


def host_profile(fn, rows: int, label: str) -> None:
    """Runs ``fn`` once under cProfile (no torch profiler, no sampler): the engine thread's
    host time by function, own time and cumulative, ``rows`` lines each."""
    wg.cprofiled(fn, rows, ("tottime", "cumulative"),
                 f"\n## {label}: cProfile, wall {{wall_ms:.1f}} ms")


def serve_scenario(hf, args, dev: str, dtype: torch.dtype):
    """(engine, callable, threads): the in-process server under ``edserve bench``."""
    import math
    import subprocess
    from pathlib import Path

    from edserve.engine.async_engine import AsyncEngine
    from edserve.server.app import create_app
    from edserve.server.config import ServerConfig
    from edserve.server.launch import ServerThread

    strategy, ps = args.config.split(":")
    engine = wg.make_engine(hf, args.arch, 64, args.new_tokens, device=dev,
                            dtype=str(dtype)[6:], encoder_kv=strategy, page_size=ps,
                            context_length=2 * args.new_tokens, debug_checks=False)
    aengine = AsyncEngine(engine).start()
    app = create_app(aengine, ServerConfig(compression_ratio_threshold=math.inf,
                                           logprob_threshold=-math.inf,
                                           no_speech_threshold=math.inf))
    app.state.audio.start()
    server = ServerThread(app)
    server.start()
    clip = Path(__file__).resolve().parent.parent / "tests" / "data" / "jfk.wav"

    def load(n: int, c: int) -> None:
        subprocess.run([sys.executable, "-m", "edserve", "bench", "--base-url",
                        f"http://{server.host}:{server.port}", "--num-requests", str(n),
                        "--concurrency", str(c), "--no-progress", str(clip)], check=True)
    load(16, 8)  # warm-up
    return engine, lambda: load(args.requests, args.concurrency), ("edserve-engine", "edserve-http")


def beam_scenario(hf, args, dev: str):
    """(engine, callable): 30 steady steps of 64 requests x beam 5 on the device."""
    import beam_gpu

    strategy, ps = args.config.split(":")
    n, beam = 64, 5
    engine = beam_gpu.make_engine(hf, args.arch, n, beam, 200, strategy, ps, dev,
                                  beam_on_device=True)
    gen = torch.Generator().manual_seed(0)
    feats = (torch.randn(n, wg.ARCHS[args.arch]["n_mels"], 3000, generator=gen) * 0.5).to(dev)
    for r in beam_gpu.make_requests(engine, feats, 200, beam):
        engine.add_request(r)
    for _ in range(12):  # every group admitted, forked and decoding
        engine.step()
    print(f"beam64: {len(engine.scheduler.running)} rows decoding")

    def steps() -> None:
        for _ in range(30):
            engine.step()
    return engine, steps


def scenario(name: str, hf, args, dev: str, dtype: torch.dtype):
    """(engine, callable) of one scenario; the engine is warm."""
    if name == "beam64":
        return beam_scenario(hf, args, dev)
    strategy, ps = args.config.split(":")
    n = {"arrivals": args.requests, "prefill16": 16, "decode64": 64, "decode1": 1}[name]
    tokens = 200 if name.startswith("decode") else args.new_tokens
    engine = wg.make_engine(hf, args.arch, n, tokens, device=dev, dtype=str(dtype)[6:],
                            encoder_kv=strategy, page_size=ps, max_prefill_tokens=24576,
                            debug_checks=False,
                            sampling_cuda_graph=args.sampling_graph == "on")
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(wg.ARCHS[args.arch]["n_mels"], 3000, generator=gen) * 0.5
            for _ in range(n)]
    engine.generate(requests(engine, mels[:4], 2))  # warm-up
    if name == "arrivals":
        def drive() -> None:
            rate = callers(engine, requests(engine, mels, tokens), args.concurrency)[0]
            print(f"callers: {rate:.1f} req/s (while sampled)")
        return engine, drive
    if name == "prefill16":
        sp = SamplingParams(max_new_tokens=1, ignore_eos=True)

        def admit() -> None:
            for m in mels:
                engine.add_request(GenerateRequest([engine.tokenizer.sot], m, sp))
            wg.drain(engine)
        admit()  # warm this batch size
        return engine, admit
    for r in requests(engine, mels, tokens):
        engine.add_request(r)
    for _ in range(8):  # every row admitted and decoding
        engine.step()

    def steps() -> None:
        for _ in range(30):
            engine.step()
    return engine, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--scenarios", nargs="+", default=["arrivals", "prefill16", "decode64"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--config", default="flat:128", help="strategy:page_size")
    ap.add_argument("--sampling-graph", default="on", choices=("on", "off"),
                    help="replay graph steps' sampling as CUDA graphs (--sampling-cuda-graph)")
    ap.add_argument("--interval-us", type=float, default=200.0)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="instead of the idle table: cProfile of the scenario, N functions "
                         "by own and by cumulative time (not for 'serve')")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    dev, dtype = device_and_dtype(args)
    hf = wg.build_hf(args.arch, dev, dtype)
    print(f"# {args.arch} {args.config}, sampling every {args.interval_us:.0f} us")
    for name in args.scenarios:
        if name == "serve":
            engine, fn, threads = serve_scenario(hf, args, dev, dtype)
            idle_by_frame(fn, dev, args.interval_us, args.rows, name, threads, engine)
            continue  # the server's engine keeps running until the process exits
        engine, fn = scenario(name, hf, args, dev, dtype)
        if args.cprofile:
            host_profile(fn, args.cprofile, name)
        else:
            idle_by_frame(fn, dev, args.interval_us, args.rows, name, engine=engine)
        engine.check_integrity()
        del engine, fn


if __name__ == "__main__":
    main()
