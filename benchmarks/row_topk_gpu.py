"""Beam candidates' top-k alone: ``torch.topk`` over the selected rows vs the one-pass Triton
kernel (:mod:`edserve.kernels.row_topk`) at several launch shapes, microseconds per call in a
CUDA graph, every variant checked against torch first.

  python benchmarks/row_topk_gpu.py             # H200: ~20 s
  python benchmarks/row_topk_gpu.py --dry-run   # tiny shapes, Triton interpreter on CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import graph_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = [(64, 320, 6), (64, 64, 6), (80, 16, 6), (320, 320, 11)]  # (batch rows, beam rows, k)
SHAPES = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)]  # (block, warps)


def case_row(B: int, G: int, k: int, V: int, dev: str, shapes, bench) -> None:
    import torch

    from edserve.kernels.row_topk import row_topk

    g = torch.Generator().manual_seed(B + G + k)
    logits = (torch.randn(max(B, G), V, generator=g) * 3).to(dev)
    logits[:, ::7] = float("-inf")  # suppressed tokens
    rows = torch.randperm(max(B, G), generator=g)[:G].to(dev)
    ref_v, _ = torch.topk(logits.index_select(0, rows), k, dim=-1)
    cells = [f"torch {bench(lambda: torch.topk(logits.index_select(0, rows), k)):6.1f}"]
    for block, warps in [(None, None), *shapes]:
        def fn(block=block, warps=warps):
            return row_topk(logits, rows, k, block=block, num_warps=warps)
        assert torch.equal(fn()[0], ref_v)
        name = "triton default" if block is None else f"triton {block}/{warps}"
        cells.append(f"{name} {bench(fn):6.1f}")
    print(f"{G:3d} rows of {V} (k={k}), us: " + " | ".join(cells), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=51866)
    args = graph_bench.parse(ap, argv)
    if args is None:
        return 2
    dev = "cpu" if args.dry_run else "cuda"
    cases, shapes, V = ([(4, 3, 2)], [(64, 1)], 300) if args.dry_run else \
        (CASES, SHAPES, args.vocab)

    def bench(fn) -> float:
        return graph_bench.us_per_call(fn, args.dry_run)

    for B, G, k in cases:
        case_row(B, G, k, V, dev, shapes, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
