"""Beam candidates' top-k alone: ``torch.topk`` over the selected rows vs the one-pass Triton
kernel (:mod:`edserve.kernels.row_topk`) at several launch shapes, microseconds per call in a
CUDA graph, every variant checked against torch first. Then the sampler's whole read of the
logits for a beam step: torch's argmax + logsumexp + that top-k + the subtraction against the
fused kernel (:mod:`edserve.kernels.logit_stats`) at several (chunks, block, warps).

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


STATS_SHAPES = [(1, 4096, 4), (2, 2048, 4), (4, 2048, 4), (8, 1024, 4), (16, 1024, 4),
                (4, 4096, 8), (8, 2048, 4)]


def stats_row(B: int, k: int, V: int, dev: str, shapes, bench) -> None:
    """A beam batch (every row a top-k row): torch's ops as the sampler ran them vs fused."""
    import torch

    from edserve.kernels.logit_stats import logit_stats
    from edserve.kernels.row_topk import row_topk

    g = torch.Generator().manual_seed(B + k)
    logits = (torch.randn(B, V, generator=g) * 3).to(dev)
    logits[:, ::7] = float("-inf")
    rows = torch.arange(B, device=dev)

    def torch_way():
        arg = torch.argmax(logits, dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        vals, idx = row_topk(logits, rows, k)
        return arg, lse, vals - lse.index_select(0, rows)[:, None], idx

    def fused(shape=None):
        slot = torch.full((B,), -1, dtype=torch.int32, device=dev)
        slot.index_copy_(0, rows, torch.arange(B, dtype=torch.int32, device=dev))
        return logit_stats(logits, slot, B, k, shape=shape)

    ref = torch_way()
    cells = [f"torch+row_topk {bench(torch_way):6.1f}"]
    for shape in [None, *shapes]:
        out = fused(shape)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[3], ref[3])
        torch.testing.assert_close(out[1], ref[1])
        torch.testing.assert_close(out[2], ref[2])
        name = "fused default" if shape is None else "fused " + "/".join(map(str, shape))
        cells.append(f"{name} {bench(lambda shape=shape: fused(shape)):6.1f}")
    print(f"{B:3d} beam rows of {V} (k={k}), us: " + " | ".join(cells), flush=True)


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
    stats = [(3, 2)] if args.dry_run else [(320, 6), (64, 6), (160, 6)]
    for B, k in stats:
        stats_row(B, k, V, dev, [(2, 64, 1)] if args.dry_run else STATS_SHAPES, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
