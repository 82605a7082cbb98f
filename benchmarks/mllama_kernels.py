"""Mllama 11B decode-step kernels alone: cross-attention split-KV factors, fused row-wise ops.

1. ``flat_attention`` at the 11B cross-attention decode shape (32 q / 8 kv heads of 128; one
   query per row; image rows of 4, 1, 2, 3, ... tiles of 1601 keys, text rows with none; page
   size 1, slots shuffled): achieved K/V read bandwidth for the automatic split-KV factor and
   for forced factors, at ``--batches`` image rows (+ 1/8 text rows). Every factor's output is
   checked against the unsplit one.
2. ``paged_attention`` at the 11B self-attention decode shape as a CUDA-graph step calls it
   (aligned/128: the page table spans whole rows, 4 tiles of image keys then the decoder's
   pages; each row has ``--history`` decoder keys): the automatic split-KV factor against
   forced ones (8 was the automatic choice before self-attention stopped taking the long-range
   split), each checked against the unsplit output.
3. RMSNorm ``[rows, 4096]``, SiLU-and-multiply ``[rows, 14336]`` and RoPE ``[rows, 32, 128]``:
   the Triton kernels (checked against) and the torch ops they replace, microseconds per call.

  python benchmarks/mllama_kernels.py             # H200: ~30 s
  python benchmarks/mllama_kernels.py --dry-run   # tiny shapes, Triton interpreter on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bench_us(fn, device: str, reps: int) -> float:
    """Median microseconds of ``fn()`` (CUDA: triton's do_bench; CPU: wall clock)."""
    if device == "cuda":
        from triton.testing import do_bench

        return 1000 * do_bench(fn, return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e6 * (time.perf_counter() - t0) / reps


def cross_case(n_img: int, P: int, hkv: int, hq: int, d: int, device: str, dtype):
    import torch

    n_txt = max(1, round(n_img / 8))
    B = n_img + n_txt
    lens = [((i + 3) % 4 + 1) * P for i in range(n_img)] + [0] * n_txt
    cols = 4 * P + 128
    total = sum(lens) + 1
    g = torch.Generator().manual_seed(n_img)
    perm = torch.randperm(total - 1, generator=g) + 1  # slot 0 = padding
    r2t = torch.zeros(B, cols, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        r2t[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    k = torch.randn(total, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(total, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ranges = torch.stack([torch.zeros_like(kv_lens), kv_lens], 1).contiguous()
    args = (q, k, v, r2t.to(device), torch.arange(B, device=device),
            torch.zeros(B, dtype=torch.int32, device=device), kv_lens,
            torch.arange(B + 1, dtype=torch.int32, device=device), 1, False, d ** -0.5)
    return args, ranges, sum(lens) * hkv * d * 2 * q.element_size(), B


def split_timings(attend, dtype, device: str, splits: list, reps: int
                  ) -> list[tuple[str, float]]:
    """``attend(num_splits)`` with the automatic factor (None) and each of ``splits``: every
    output checked against the unsplit one, then timed; (label, us) per factor."""
    import torch

    ref = attend(1)
    out = []
    for s in [None, *splits]:
        err = (attend(s).float() - ref.float()).abs().max().item()
        if err > (1e-5 if dtype == torch.float32 else 2e-2):
            raise AssertionError(f"num_splits={s}: max |out - unsplit| = {err}")
        out.append(("auto" if s is None else str(s),
                    bench_us(lambda s=s: attend(s), device, reps)))
    return out


def cross_row(n: int, P: int, hkv: int, hq: int, d: int, device: str, dtype, splits: list,
              reps: int) -> None:

    from edserve.kernels.flat_attention import flat_attention

    a, rng, nbytes, B = cross_case(n, P, hkv, hq, d, device, dtype)
    timed = split_timings(lambda s: flat_attention(*a, kv_ranges=rng, num_splits=s), dtype,
                          device, splits, reps)
    row = [f"{label}: {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s" for label, us in timed]
    print(f"{n:3d} img + {B - n:2d} txt ({nbytes / 1e6:6.1f} MB): " + " | ".join(row),
          flush=True)


def self_row(rows: int, history: int, hkv: int, hq: int, d: int, device: str, dtype,
             splits: list, reps: int, page: int = 128) -> None:
    import torch

    from edserve.kernels.paged_attention import paged_attention

    g = torch.Generator().manual_seed(rows)
    enc_pages = -(-4 * 1601 // page) if d >= 64 else 2  # the image region's pages
    dec_pages = -(-max(history, 2048) // page)  # the decoder's room in a graph's table
    width = enc_pages + dec_pages
    n_slots = (rows * dec_pages + 1) * page  # page 0: padding
    pages = (torch.randperm(rows * dec_pages, generator=g) + 1).view(rows, dec_pages)
    table = torch.zeros(rows, width, dtype=torch.int32)
    table[:, enc_pages:] = pages.to(torch.int32)
    k = torch.randn(n_slots, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(n_slots, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(rows, hq, d, generator=g).to(device, dtype)
    lens = torch.full((rows,), history, dtype=torch.int32, device=device)
    start = torch.full((rows,), enc_pages, dtype=torch.int32, device=device)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=device)
    args = (q, k, v, table.to(device), start, lens, cu, 1, True, d ** -0.5, page)
    nbytes = rows * history * hkv * d * 2 * q.element_size()
    timed = split_timings(lambda sp: paged_attention(*args, num_splits=sp), dtype, device,
                          splits, reps)
    row = [f"{label}: {us:6.1f} us" for label, us in timed]
    print(f"self {rows:3d} rows x {history:5d} keys ({nbytes / 1e6:6.2f} MB, table "
          f"{width} pages): " + " | ".join(row), flush=True)


def rowwise_row(rows: int, hidden: int, inter: int, device: str, dtype, reps: int) -> None:
    import torch

    from edserve.kernels.norm_act import rms_norm, silu_mul
    from edserve.kernels.rope import rope
    from edserve.layers.elementwise import rms_norm_torch, rope_torch, silu_mul_torch

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    gu = torch.randn(rows, 2 * inter, generator=g).to(device, dtype)
    gate, up = gu[:, :inter], gu[:, inter:]
    hd = 128 if hidden >= 128 else 16
    q = x.view(rows, hidden // hd, hd)  # the self-attention queries' shape
    cos, sin = (torch.rand(rows, 1, hd, generator=g).to(device, dtype) for _ in range(2))
    pairs = {"rms_norm": (lambda: rms_norm(x, w, 1e-5), lambda: rms_norm_torch(x, w, 1e-5)),
             "silu_mul": (lambda: silu_mul(gate, up), lambda: silu_mul_torch(gate, up)),
             "rope": (lambda: rope(q, cos, sin), lambda: rope_torch(q, cos, sin))}
    t = {}
    for name, (fused, ref) in pairs.items():
        # <= 2 bf16 ulps; fused multiply-adds round once, so sums that cancel to 0 in torch
        # (two rounded products) may keep a last-ulp residue
        torch.testing.assert_close(fused(), ref(), atol=2 ** -7, rtol=2 ** -6)
        t[name] = bench_us(fused, device, reps)
        t[f"{name} torch"] = bench_us(ref, device, reps)
    print(f"rows {rows:3d}: " + " | ".join(f"{k} {v:6.1f} us" for k, v in t.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64", help="image rows per batch")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreter")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run")
        return 2
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    P, hkv, hq, d, hidden, inter = (17, 2, 4, 16, 64, 96) if args.dry_run else \
        (1601, 8, 32, 128, 4096, 14336)
    batches = [2] if args.dry_run else [int(x) for x in args.batches.split(",")]
    splits = [1, 2] if args.dry_run else [int(x) for x in args.splits.split(",")]
    reps = 1 if args.dry_run else 20
    print(f"# cross-attention decode on {device} {dtype}: {hq} q / {hkv} kv heads of {d}, "
          f"P={P}", flush=True)
    for n in batches:
        cross_row(n, P, hkv, hq, d, device, dtype, splits, reps)
    for rows, hist in ([(3, 5)] if args.dry_run else
                       [(1, 48), (18, 48), (72, 48), (72, 1024), (72, 2048)]):
        self_row(rows, hist, hkv, hq, d, device, dtype, [1, 8], reps,
                 page=16 if args.dry_run else 128)
    for rows in ([3] if args.dry_run else [1, 18, 72]):
        rowwise_row(rows, hidden, inter, device, dtype, reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
