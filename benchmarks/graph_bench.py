"""What the small kernel benchmarks share: ``--dry-run`` (tiny shapes, the Triton interpreter on
CPU) and the time of one call replayed in a CUDA graph."""

from __future__ import annotations

import argparse
import os
import time


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace | None:
    """Add ``--dry-run``, parse, and set the interpreter before triton is imported. None when
    there is no CUDA device and no ``--dry-run`` (the caller exits 2)."""
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreter")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run")
        return None
    return args


def us_per_call(fn, dry_run: bool) -> float:
    """Microseconds of one ``fn()`` replayed in a CUDA graph (``do_bench_cudagraph``); on a dry
    run one wall-clock call after a warm-up."""
    if dry_run:
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    from triton.testing import do_bench_cudagraph

    return 1000 * do_bench_cudagraph(fn, rep=50)
