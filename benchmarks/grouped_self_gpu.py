"""Decoder self-attention of a beam decode step on the GPU: the grouped kernel (a group's
shared token prefix read once, :mod:`edserve.kernels.grouped_self_attention`) against the
per-row kernels the engine ran before (flat: by token; aligned: the paged kernel), on the same
K/V.

Rows as in a large-v3 beam step: ``--groups`` groups of ``--beam`` rows (20 heads x 64, one
query each), decoder regions of ``4 + --len`` keys in pages of 128 (a row's pages at random
places), the rows of a group sharing the prompt and the first ``lcp`` sampled tokens (their
K/V bit-identical there, as in the engine): ``--shares`` picks ``lcp`` as a fraction of
``--len`` (1.0: the rows differ only in their last token; 0: only the prompt is shared).
``greedy`` rows are groups of one. Each grouped result is checked against its per-row kernel
before it is timed. One layer's call replayed from a CUDA graph (an eager launch's host time
would hide the kernel's), median us, and the K/V bytes each must read.

  python benchmarks/grouped_self_gpu.py --len 50 100 --shares 1 0.5 0
  python benchmarks/grouped_self_gpu.py --dry-run   # CPU, Triton interpreter: the script runs
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from kernel_timing import copy_gbs, device_label, graph_ms, median_ms  # noqa: E402

from edserve.kernels import grouped_self_attention as gsa  # noqa: E402
from edserve.kernels.flat_attention import flat_attention  # noqa: E402
from edserve.kernels.paged_attention import paged_attention  # noqa: E402

PROMPT = 4
FLAT_START = 1500  # flat: the decoder region starts mid-page, after the encoder's keys
PAGED_START = 1536  # aligned: at the encoder's padded end (12 pages of 128)


def problem(groups: int, beam: int, length: int, share: float, shape: tuple, dtype, dev: str,
            seed: int = 0) -> dict:
    heads, dim, page = shape
    rows = groups * beam
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-(PAGED_START + PROMPT + length) // page)
    n_pages = rows * per_row + 1
    k = torch.randn(n_pages * page, heads, dim, generator=gen).to(dtype)
    v = torch.randn(n_pages * page, heads, dim, generator=gen).to(dtype)
    table = (torch.randperm(n_pages - 1, generator=gen)[:rows * per_row] + 1).view(rows, -1)
    cols = torch.arange(per_row * page)
    r2t = table[:, cols // page] * page + cols % page  # [rows, cols] slot of each column
    hist = torch.randint(0, 51865, (rows + 1, 448), generator=gen)
    lcp = int(round(share * (length - 1)))  # tokens every row of a group shares
    for g in range(groups):
        lead = g * beam
        for m in range(lead + 1, lead + beam):
            hist[m + 1, :lcp] = hist[lead + 1, :lcp]  # history rows = pool rows = row + 1
            for start in (FLAT_START, PAGED_START):  # the shared keys hold the lead's values
                src, dst = r2t[lead, start:start + PROMPT + lcp], r2t[m, start:start + PROMPT + lcp]
                k[dst], v[dst] = k[src], v[src]
    hist_lens = torch.full((rows + 1,), length, dtype=torch.int64)
    group_rows = torch.full((rows, 16), -1, dtype=torch.int64)
    group_rows[:groups, :beam] = torch.arange(rows).view(groups, beam)
    req_to_token = torch.cat([torch.zeros(1, r2t.shape[1], dtype=r2t.dtype), r2t])
    t = {"q": torch.randn(rows, heads, dim, generator=gen).to(dtype), "k": k, "v": v,
         "r2t": req_to_token.to(torch.int32), "table": table.to(torch.int32),
         "pool_rows": torch.arange(1, rows + 1), "lens": torch.full((rows,), PROMPT + length),
         "flat_start": torch.full((rows,), FLAT_START), "cu": torch.arange(rows + 1),
         "page_start": torch.full((rows,), PAGED_START // page), "groups": group_rows,
         "hist": hist, "hist_lens": hist_lens}
    t = {n: x.to(dev) for n, x in t.items()}
    bytes_row = (PROMPT + length) * heads * dim * 2 * k.element_size()
    shared = (PROMPT + lcp) * heads * dim * 2 * k.element_size()
    t["bytes"] = (rows * bytes_row, groups * shared + rows * (bytes_row - shared))
    return t


def calls(t: dict, page: int, scale: float) -> dict:
    common = (t["q"], t["k"], t["v"])
    grouped = (t["groups"], t["lens"])
    tail = (t["pool_rows"], t["hist"], t["hist_lens"], scale)
    return {
        "flat": lambda: flat_attention(*common, t["r2t"], t["pool_rows"], t["flat_start"],
                                       t["lens"], t["cu"], 1, True, scale),
        "grouped by token": lambda: gsa.grouped_self_attention(
            *common, *grouped, t["flat_start"], *tail, req_to_token=t["r2t"]),
        "paged": lambda: paged_attention(*common, t["table"], t["page_start"], t["lens"],
                                         t["cu"], 1, True, scale, page),
        "grouped by page": lambda: gsa.grouped_self_attention(
            *common, *grouped, t["page_start"], *tail, page_table=t["table"], page_size=page),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--beam", nargs="+", type=int, default=[5, 1], help="1: greedy rows")
    ap.add_argument("--len", nargs="+", type=int, default=[50, 100], help="sampled tokens")
    ap.add_argument("--shares", nargs="+", type=float, default=[1.0, 0.5, 0.0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shape = (2, 16, 16) if args.dry_run else (20, 64, 128)  # heads, dim, page
    if args.dry_run:
        args.groups, args.len = 2, [6]
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    gbs = copy_gbs(dev, lambda fn: median_ms(fn, dev, rep=100), args.dry_run)
    bench = (lambda fn: graph_ms(fn, dev, rep=100))  # replayed as the engine does: device time
    print(f"# {device_label(dev)}: {args.groups} groups, {shape[0]} heads x {shape[1]}, pages "
          f"of {shape[2]}, prompt {PROMPT} keys, copy {gbs:.0f} GB/s")
    print("| beam | len | share | per-row MB / floor us | grouped MB / floor us | "
          "flat us | grouped by token us | paged us | grouped by page us | max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    run(args, dev, shape, dtype, bench, gbs)
    return 0


def run(args, dev: torch.device, shape: tuple, dtype, bench, gbs: float) -> None:
    for beam in args.beam:
        for length in args.len:
            for share in (args.shares if beam > 1 else [1.0]):
                t = problem(args.groups, beam, length, share, shape, dtype, dev.type)
                fns = calls(t, shape[2], shape[1] ** -0.5)
                diff = max((fns["grouped by token"]().float() - fns["flat"]().float())
                           .abs().max().item(),
                           (fns["grouped by page"]().float() - fns["paged"]().float())
                           .abs().max().item())
                assert diff < (1e-4 if args.dry_run else 2e-2), diff
                us = {n: 1000 * bench(f) for n, f in fns.items()}
                (a, b) = t["bytes"]
                print(f"| {beam} | {length} | {share:g} | {a / 1e6:.1f} / "
                      f"{a / gbs / 1e3:.1f} | {b / 1e6:.1f} / {b / gbs / 1e3:.1f} | "
                      + " | ".join(f"{us[n]:.1f}" for n in fns) + f" | {diff:.1e} |",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
