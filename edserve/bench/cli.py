"""``edserve bench``: flags -> load plan -> run -> printed summary (and ``--json``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def _field(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _positive_float(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="Benchmark an OpenAI-compatible audio server (edserve, "
                       "vLLM, Speaches): throughput, latency percentiles, failures.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="+", help="Audio files, folders, or manifests (.txt: one "
                   "path a line; .jsonl: 'file' fields); cycled to --num-requests.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root (the requests go to <base-url>/v1/audio/<endpoint>).")
    p.add_argument("--endpoint", default="transcriptions",
                   choices=("transcriptions", "translations"))
    p.add_argument("--model", default="whisper-1", help="The form's 'model' field.")
    p.add_argument("--response-format", default="json", choices=RESPONSE_FORMATS)
    p.add_argument("--stream", action="store_true", help="Send stream=true (SSE) and record "
                   "the time to the first text delta.")
    p.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")
    p.add_argument("--field", type=_field, action="append", default=[], metavar="KEY=VALUE",
                   help="Extra form field (repeatable), e.g. beam_size=5 or language=en.")
    p.add_argument("--num-requests", type=_positive_int, default=100)
    p.add_argument("--concurrency", type=_positive_int, default=None,
                   help="Requests in flight at most (default: 1 without --request-rate, "
                   "unbounded with it).")
    p.add_argument("--request-rate", type=_positive_float, default=None,
                   help="Poisson arrivals at this many requests/s (seeded) instead of "
                   "sending as fast as --concurrency allows.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the arrival schedule.")
    p.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="Seconds per request.")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="Write the result as JSON to PATH ('-': stdout, then no table).")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edserve.bench.client import BenchTarget, LoadPlan, run_load
    from edserve.bench.load import arrival_offsets, load_items, request_plan
    from edserve.bench.report import (
        format_summary,
        scrape,
        stage_delta,
        step_delta,
        summarize,
    )

    try:
        items = request_plan(load_items(args.inputs), args.num_requests)
    except ValueError as exc:
        print(f"edserve bench: {exc}", file=sys.stderr)
        return 2
    target = BenchTarget(args.base_url, args.endpoint, args.model, args.response_format,
                         args.stream, args.api_key, tuple(args.field), args.timeout)
    concurrency = args.concurrency or (len(items) if args.request_rate else 1)
    offsets = arrival_offsets(len(items), args.request_rate, args.seed) \
        if args.request_rate else None
    plan = LoadPlan(items, concurrency, offsets)
    config: dict[str, Any] = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": args.model,
        "response_format": args.response_format, "stream": args.stream,
        "fields": dict(args.field), "num_requests": len(items), "concurrency": concurrency,
        "request_rate": args.request_rate, "seed": args.seed}
    before, steps0 = scrape(args.base_url, target.headers())
    with tqdm(total=len(items), desc="requests", unit="req", file=sys.stderr,
              disable=args.no_progress) as bar:
        plan.on_done.append(lambda _: bar.update())
        cpu0 = time.process_time()
        results, wall = asyncio.run(run_load(target, plan))
        client_cpu = time.process_time() - cpu0
    after, steps1 = scrape(args.base_url, target.headers()) \
        if before is not None or steps0 is not None else (None, None)
    summary = summarize(results, wall, config, stage_delta(before, after),
                        step_delta(steps0, steps1, wall), client_cpu)
    if args.json != "-":
        print(format_summary(summary))
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0 if summary["completed"] else 1
