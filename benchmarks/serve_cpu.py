"""CPU: ``edserve serve`` at N concurrent clients vs ``edserve transcribe`` (the in-process
driver) on the same files, embedded tiny.en (issue 18's CPU target: serve >= 0.8x).

Starts ``python -m edserve serve`` (the checkout on ``--server-path``, default this one: an
older checkout gives a before/after figure with the same client), warms it up, drives it with
``edserve bench``'s client, then times :func:`edserve.whisper.transcribe.transcribe` in this
process on the same list of files (greedy, like the server's default; same thread count).

  python benchmarks/serve_cpu.py --requests 24 --concurrency 8 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from proc_stats import cpu_delta, cpu_figures, thread_cpu  # noqa: E402

from edserve.bench.client import BenchTarget, LoadPlan, run_load  # noqa: E402
from edserve.bench.load import load_items, request_plan  # noqa: E402
from edserve.bench.report import scrape_stages, stage_delta, summarize  # noqa: E402

CLIPS = [str(ROOT / "tests" / "data" / f"{c}.wav") for c in ("jfk", "librivox_0870",
                                                              "cards_005")]


def serve_figure(args) -> dict:
    from tests.server.server_helpers import start_server

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [args.server_path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                              if p and p != str(ROOT)]))
    proc, url = start_server(Path(tempfile.mkdtemp()) / "serve.log", "--threads",
                             str(args.threads), "--max-running-requests", str(args.rows),
                             *args.serve_flags.split(), env=env, cwd=args.server_path)
    try:
        items = request_plan(load_items(CLIPS), args.requests)
        target = BenchTarget(url)
        asyncio.run(run_load(target, LoadPlan(items[:args.concurrency], args.concurrency)))
        before, cpu0 = scrape_stages(url), thread_cpu(proc.pid)
        results, wall = asyncio.run(run_load(target, LoadPlan(items, args.concurrency)))
        cpu = cpu_delta(cpu0, thread_cpu(proc.pid))
        s = summarize(results, wall, {}, stage_delta(before, scrape_stages(url)))
        s.update(cpu_figures(cpu, len(items), wall))
        return s
    finally:
        proc.terminate()
        proc.wait(30)


def transcribe_figure(args) -> float:
    """Requests/s of the in-process driver on the same files (model load not counted)."""
    from edserve.runtime import build_engine
    from edserve.whisper.transcribe import transcribe

    files = [CLIPS[i % len(CLIPS)] for i in range(args.requests)]
    engine = build_engine(threads=args.threads, max_running_requests=args.rows)
    transcribe(engine, files[:2])  # warm-up
    t0 = time.perf_counter()
    transcribe(engine, files)  # decodes the files too, as edserve transcribe does
    return args.requests / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=16, help="--max-running-requests")
    ap.add_argument("--server-path", default=str(ROOT), help="checkout the server runs")
    ap.add_argument("--serve-flags", default="", help="more `edserve serve` flags, given "
                    "with '=', e.g. --serve-flags='--audio-workers 0'")
    ap.add_argument("--skip-transcribe", action="store_true")
    args = ap.parse_args()
    s = serve_figure(args)
    print(f"serve ({args.server_path}): {s['requests_per_s']:.3f} req/s at {args.concurrency} "
          f"clients, p50 {s['latency_ms']['p50']:.0f} ms, failed {s['failed']}, API CPU "
          f"{s['api_cpu_ms_per_request']:.1f} ms/req, engine CPU "
          f"{s['engine_cpu_ms_per_request']:.1f} ms/req (busy {100 * s['engine_thread_busy']:.0f} "
          f"%; rest of an engine process {s['engine_proc_cpu_ms_per_request']:.1f}), audio-worker "
          f"CPU "
          f"{s['helpers_cpu_ms_per_request']:.1f} ms/req", flush=True)
    for stage, d in (s["stages"] or {}).items():
        print(f"#   {stage:12s} {d['mean_ms']:9.2f} ms (n={d['count']})")
    if not args.skip_transcribe:
        rate = transcribe_figure(args)
        print(f"transcribe (one process): {rate:.3f} req/s; serve / transcribe = "
              f"{s['requests_per_s'] / rate:.2f}", flush=True)


if __name__ == "__main__":
    main()
