"""Decoder self-attention of a decode step on the GPU: the paged kernel (what ``aligned`` runs)
at key blocks of 128 and 64 against the flat kernel (what ``flat`` runs), on the same K/V.

``--variants`` sweeps the paged kernel's key-block cap, warps and stages. Rows as in a large-v3
decode step (20 heads x 64, one query each) with decoder histories of
4..``--max-len`` keys in pages of 128 (a row's pages at random places in the pool). Each
variant's output is checked against the flat kernel's before it is timed. One layer's call,
median us (``triton.testing.do_bench``), and the bytes of K/V it must read at the copy rate.

  python benchmarks/self_attn_decode_gpu.py --rows 64 320
  python benchmarks/self_attn_decode_gpu.py --dry-run   # CPU, Triton interpreter: the script runs
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from kernel_timing import copy_gbs, device_label, median_ms  # noqa: E402

from edserve.kernels import paged_attention as paged  # noqa: E402
from edserve.kernels.flat_attention import flat_attention  # noqa: E402


def with_tiles(cap: int, warps: int | None = None, stages: int | None = None):
    """The paged kernel's tile choice with key blocks capped at ``cap`` (and, if given, its
    warps and pipeline stages)."""
    orig = paged.tile_config

    def capped(block_m, block_d, dtype, want_n):
        block_n, cfg = orig(block_m, block_d, dtype, min(want_n, cap))
        cfg = dict(cfg, **({"num_warps": warps} if warps else {}),
                   **({"num_stages": stages} if stages else {}))
        return block_n, cfg
    return capped


def problem(rows: int, heads: int, dim: int, page: int, max_len: int, pages_per_row: int,
            dtype: torch.dtype, dev: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n_pages = rows * pages_per_row + 1
    k = torch.randn(n_pages * page, heads, dim, generator=gen).to(dev, dtype)
    v = torch.randn(n_pages * page, heads, dim, generator=gen).to(dev, dtype)
    q = torch.randn(rows, heads, dim, generator=gen).to(dev, dtype)
    table = torch.randperm(n_pages, generator=gen)[:rows * pages_per_row].view(rows, -1)
    lens = torch.randint(4, max_len + 1, (rows,), generator=gen)
    cols = torch.arange(pages_per_row * page)
    r2t = table[:, cols // page] * page + cols % page  # [rows, cols] the same slots, per token
    t = {"q": q, "k": k, "v": v, "table": table.to(dev), "r2t": r2t.to(dev),
         "start": torch.zeros(rows, dtype=torch.int64, device=dev), "lens": lens.to(dev),
         "cu": torch.arange(rows + 1, device=dev), "rows": torch.arange(rows, device=dev)}
    return t, int(lens.sum()) * heads * dim * 2 * k.element_size()


def measure(rows: int, args, dev: torch.device, shape: tuple, dtype, bench, gbs: float) -> None:
    heads, dim, page, ppr = shape
    t, nbytes = problem(rows, heads, dim, page, args.max_len, ppr, dtype, dev.type)
    scale = dim ** -0.5

    def flat():
        return flat_attention(t["q"], t["k"], t["v"], t["r2t"], t["rows"], t["start"],
                              t["lens"], t["cu"], 1, True, scale)

    def paged_call():
        return paged.paged_attention(t["q"], t["k"], t["v"], t["table"], t["start"], t["lens"],
                                     t["cu"], 1, True, scale, page)

    ref = flat().float()
    us, diff = {}, 0.0
    for spec in args.variants:
        cap, warps, stages = (int(x) for x in (spec.split(":") + ["0", "0"])[:3])
        orig = paged.tile_config
        paged.tile_config = with_tiles(cap, warps, stages)
        try:
            diff = max(diff, (paged_call().float() - ref).abs().max().item())
            us[spec] = 1000 * bench(paged_call)
        finally:
            paged.tile_config = orig
    us["flat"] = 1000 * bench(flat)
    floor = nbytes / (gbs * 1e9) * 1e6
    print(f"| {rows} | {nbytes / 1e6:.1f} | {floor:.1f} | {us['flat']:.1f} | "
          + " | ".join(f"{us[v]:.1f}" for v in args.variants) + f" | {diff:.2e} |", flush=True)
    assert diff < (1e-4 if args.dry_run else 2e-2), diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[64, 320])
    ap.add_argument("--max-len", type=int, default=104, help="longest decoder history")
    ap.add_argument("--variants", nargs="+", default=["128", "64"],
                    help="paged-kernel tiles: key-block cap[:warps[:stages]] (0: the default)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shape = (2, 16, 16, 2) if args.dry_run else (20, 64, 128, 14)  # heads, dim, page, pages
    if args.dry_run:
        args.rows, args.max_len = [3], 20
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    bench = (lambda fn: median_ms(fn, dev, rep=100))
    gbs = copy_gbs(dev, bench, args.dry_run)
    print(f"# {device_label(dev)}: {shape[0]} heads x {shape[1]}, pages of {shape[2]}, "
          f"histories 4..{args.max_len} keys, copy {gbs:.0f} GB/s")
    print("| rows | K/V MB | floor us | flat us | " + " | ".join(
        f"paged {v} us" for v in args.variants) + " | max diff |")
    print("|---:|---:|---:|---:|" + "---:|" * len(args.variants) + "---:|")
    for rows in args.rows:
        measure(rows, args, dev, shape, dtype, bench, gbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
