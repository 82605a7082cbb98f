"""The Whisper encoder's attention: cuDNN (SDPA) vs edserve's Triton kernels, TMA tiles swept.

Large-v3's encoder runs 20 heads of 64 over 1500 tokens, q/k/v read as strided views of the
fused qkv projection (``[N, S, 3, H, hd]`` permuted to ``[N, H, S, hd]``), as the encoder layer
calls SDPA. Per backend: ms per call (median of back-to-back calls timed by CUDA events, and the
same call replayed from a CUDA graph), useful TFLOP/s (``4 N H S^2 hd``), the host's ms per
eager call, and the largest difference from a float64 reference on the first two clips.

  python benchmarks/attn_tma_gpu.py              # H100/H200: ~1 minute
  python benchmarks/attn_tma_gpu.py --dry-run    # small shapes, CPU interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def device_ms(fn, runs: int, graph: bool) -> float:
    """Median ms per call over ``runs`` timed groups of 5 calls (or one graph of 5 calls)."""
    fn()
    torch.cuda.synchronize()
    call = fn
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(5):
                fn()
        call = g.replay
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if graph:
            call()
        else:
            for _ in range(5):
                call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 5)
    return statistics.median(times)


def host_ms(fn, runs: int) -> float:
    """Mean host ms per eager call (no sync inside the loop)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    host = (time.perf_counter() - t) * 1e3 / runs
    torch.cuda.synchronize()
    return host


def sweep(dry_run: bool) -> list:
    from edserve.kernels.tma_attention import TmaTiles

    if dry_run:
        return [TmaTiles(32, 16, 4, 2), TmaTiles(32, 16, 4, 2, 2)]
    # (block_m, block_n, warps, stages, q tiles per program); H100 wave 38: one tile a program
    # 128x64 w8 s3 / 64x128 w4 s2 best, 128-key blocks with 8 warps and 256-row blocks slow
    return [TmaTiles(*c) for c in (
        (128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (128, 64, 4, 4, 1), (64, 64, 4, 3, 1),
        (64, 128, 4, 2, 1), (128, 32, 8, 3, 1), (256, 64, 16, 3, 1), (256, 64, 16, 2, 1),
        (128, 64, 4, 3, 2), (256, 128, 16, 2, 2))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="small shapes on the CPU interpreter")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    H, S, hd = (20, 1500, 64) if dev == "cuda" else (2, 70, 64)
    batches = args.batches if dev == "cuda" else [2]
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, heads {H} x {hd}, {S} tokens, bf16")
    print(f"{'N':>3} {'kernel':28} {'ms':>8} {'graph ms':>8} {'TFLOP/s':>8} {'host ms':>8} "
          f"{'max diff':>9}")
    g = torch.Generator(device=dev).manual_seed(0)
    for N in batches:
        run_batch(N, H, S, hd, dev, g, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
