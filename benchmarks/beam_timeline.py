"""Where a timed ``beam_gpu.py`` run spends its wall time, step by step: one run of 64 requests
x beam 5 and one greedy run (forced length, ``beam_gpu``'s engine, requests and filters), with
the host clock read after every ``engine.step()`` (launches return at once; with overlap the
host waits on the device in the next step's fetch, so the gaps follow the device once it is
the bottleneck). Prints the run's phases: up to the first decode step (prefill, forks),
steady decode steps (median, p90), the last steps (groups ending), and the total.

  python benchmarks/beam_timeline.py --config flat:128
  python benchmarks/beam_timeline.py --gaps 6      # also each run's first and last 6 steps
  python benchmarks/beam_timeline.py --dry-run     # toy model on CPU: the script runs
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import beam_gpu
import torch
import whisper_gpu as wg


def timeline(engine, feats, n_new: int, beam: int, profile: bool = False
             ) -> list[tuple[float, str, int]]:
    """(seconds since submission, step kind, running rows) after each step of one run;
    ``profile``: print a cProfile of its first step and of its last one."""
    dev = str(feats.device)
    wg.sync(dev)
    t0 = time.perf_counter()
    for r in beam_gpu.make_requests(engine, feats, n_new, beam):
        engine.add_request(r)
    marks = []
    while engine.has_work():
        kind = "prefill" if engine.scheduler.waiting else "decode"
        prof = cProfile.Profile() if profile else None
        if prof is not None:
            prof.enable()
        engine.step()
        marks.append((time.perf_counter() - t0, kind, len(engine.scheduler.running)))
        if prof is not None:
            prof.disable()
            if len(marks) == 1 or not engine.has_work():
                print(f"# cProfile of step {len(marks)}")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    wg.sync(dev)
    marks.append((time.perf_counter() - t0, "synced", 0))
    return marks


def summary(name: str, marks: list[tuple[float, str, int]]) -> str:
    times = [t for t, _, _ in marks]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    first = next((i for i, (_, k, _) in enumerate(marks) if k == "decode"), len(marks) - 1)
    steady = sorted(gaps[first + 2:-4]) or [float("nan")]
    p90 = steady[int(0.9 * (len(steady) - 1))]
    return (f"| {name} | {len(marks) - 1} | {1e3 * times[first]:.1f} | "
            f"{1e3 * statistics.median(steady):.2f} | {1e3 * p90:.2f} | "
            f"{1e3 * sum(gaps[first:first + 2]):.1f} | {1e3 * sum(gaps[-4:]):.1f} | "
            f"{1e3 * times[-1]:.1f} |")


def ends(name: str, marks: list[tuple[float, str, int]], k: int) -> str:
    """The first and last ``k`` steps of a run: step kind, running rows after it, ms taken."""
    times = [0.0] + [t for t, _, _ in marks]
    rows = [f"{kind}/{n}:{1e3 * (times[i + 1] - times[i]):.1f}"
            for i, (_, kind, n) in enumerate(marks)]
    return f"# {name} first: {' '.join(rows[:k])} | last: {' '.join(rows[-k:])}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="flat:128", help="strategy:page_size")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--gaps", type=int, default=0, help="print each run's first/last N steps")
    ap.add_argument("--profile", action="store_true",
                    help="a cProfile of each mode's first and last step (one more run each)")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    arch = "toy" if args.dry_run else "large-v3"
    if args.dry_run:
        args.concurrency, args.new_tokens = 2, 6
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    hf = wg.build_hf(arch, dev, dtype)
    strategy, ps = args.config.split(":")
    engine = beam_gpu.make_engine(hf, arch, args.concurrency, args.beam, args.new_tokens,
                                  strategy, ps, dev, beam_on_device=True)
    gen = torch.Generator().manual_seed(args.concurrency)
    feats = (torch.randn(args.concurrency, wg.ARCHS[arch]["n_mels"], 3000, generator=gen)
             * 0.5).to(device=dev, dtype=dtype)
    modes = {f"beam {args.beam}": args.beam, "greedy": 1}
    for b in modes.values():  # warm-ups (Triton JIT, graphs)
        timeline(engine, feats, min(8, args.new_tokens), b)
    print(f"# {arch} {args.config}, {args.concurrency} requests, forced {args.new_tokens} "
          "tokens; ms since submission")
    print("| run | steps | first decode step at | steady step median | p90 | first two decode "
          "steps | last four steps | total |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, b in modes.items():
        for _ in range(2):
            marks = timeline(engine, feats, args.new_tokens, b)
            print(summary(name, marks), flush=True)
            if args.gaps:
                print(ends(name, marks, args.gaps), flush=True)
    if args.profile:
        for name, b in modes.items():
            print(f"# {name}: profiled run")
            timeline(engine, feats, args.new_tokens, b, profile=True)
    engine.check_integrity()
    return 0


if __name__ == "__main__":
    sys.exit(main())
