"""CPU float32 linears: MKL (``F.linear``) vs oneDNN with a prepacked weight
(``--cpu-linear onednn``, :mod:`edserve.models.cpu_linear`) at tiny.en's shapes.

Rows: 1 (greedy decode), 2-5 (beam groups), 1500 (one encoder window). Medians of interleaved
rounds, milliseconds per call, with the largest absolute difference between the two.

  python benchmarks/cpu_linear.py [--threads 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (in, out, what) at tiny.en's width 384
SHAPES = ((384, 384, "attention out / cross q"), (384, 1152, "fused qkv"),
          (384, 1536, "fc1"), (1536, 384, "fc2"), (384, 51864, "logits (tied embedding)"))
ROWS = (1, 2, 5, 1500)


def main() -> None:
    from cpu_step import cpu_description

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_description()}; threads {args.threads}; medians of {args.rounds} rounds")
    print("| shape | rows | MKL ms | oneDNN ms | MKL / oneDNN | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, n, what in SHAPES:
        torch.manual_seed(0)
        w, b = torch.randn(n, k) / k ** 0.5, torch.randn(n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for rows in ROWS:
            if rows == 1500 and n > 10000:
                continue  # the logits never see an encoder window
            x = torch.randn(rows, k)
            fns = {"mkl": lambda x=x, w=w, b=b: F.linear(x, w, b),
                   "onednn": lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(
                       x, p, b, "none", [], "")}
            times = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            a, c = (statistics.median(times[name]) * 1e3 for name in ("mkl", "onednn"))
            diff = float((fns["mkl"]() - fns["onednn"]()).abs().max())
            print(f"| {k}x{n} {what} | {rows} | {a:.3f} | {c:.3f} | {a / c:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
