"""The decoder's linear layers at decode batch sizes: how close to the weight-read floor?

A large-v3 decode step at 64 rows spends ~1.3 ms in its 192 GEMMs (6 per layer) for ~1.5 GB of
weights (~0.35 ms at the copy rate): at M <= 320 rows each GEMM is bound by its launch and its
grid, not by bytes. This prints, per decoder linear shape and rows M, the time of one call
replayed in a CUDA graph (``triton.testing.do_bench_cudagraph``, as the decode graphs run it)
and the weight bytes / time, for:

* ``torch``: ``F.linear`` with bias (what the model runs: cuBLASLt with a bias epilogue);
* ``cublas``: the same with ``torch.backends.cuda.preferred_blas_library("cublas")``;
* ``triton BNxBK/sS/splitK``: a plain Triton GEMM (bias in the epilogue) at a few tile shapes;
  split-K > 1 adds fp32 partial sums into a zeroed buffer (atomics), then casts: 3 kernels.

Every variant is checked against ``torch`` first.

  python benchmarks/decode_gemm_gpu.py             # H200: ~1 minute
  python benchmarks/decode_gemm_gpu.py --dry-run   # tiny shapes, Triton interpreter on CPU
"""

from __future__ import annotations

import argparse
import sys

import graph_bench

# large-v3 decoder linears (K -> N): q/k/v fused, attention out, cross q, cross out, fc1, fc2
SHAPES = [(1280, 3840), (1280, 1280), (1280, 5120), (5120, 1280)]
TILES = [(16, 128, 1), (32, 128, 1), (64, 128, 1), (32, 256, 1), (16, 256, 2), (32, 128, 4),
         (64, 128, 4)]


def triton_linear():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, W, B, Y, Acc, M, N, K, stride_x, stride_w, stride_y,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        k_per = tl.cdiv(K, SPLIT * BK) * BK
        for k0 in range(pid_k * k_per, tl.minimum(K, pid_k * k_per + k_per), BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(X + rm[:, None] * stride_x + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :] * stride_w + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)  # [BK, BN]
            acc += tl.dot(x, w)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=mask)
        else:
            tl.atomic_add(Acc + rm[:, None] * N + rn[None, :], acc, mask=mask)

    def run(x, w, b, bn, bk, split, stages=4):
        M, K = x.shape
        N = w.shape[0]
        bm = max(16, min(64, triton.next_power_of_2(M)))
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        acc = torch.zeros(M, N, dtype=torch.float32, device=x.device) if split > 1 else y
        grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
        kernel[grid](x, w, b, y, acc, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                     BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=4, num_stages=stages)
        if split > 1:
            y = (acc + b.float()).to(x.dtype)
        return y

    return run


def shape_row(M: int, K: int, N: int, dev: str, dtype, tiles, lin, bench, cublas: bool
              ) -> dict[str, float]:
    """One shape at M rows: every variant checked against torch, then timed (us)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(K + N + M)
    x = torch.randn(M, K, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dtype)
    b = torch.randn(N, generator=g).to(dev, dtype)
    ref = F.linear(x, w, b)

    def with_cublas():
        torch.backends.cuda.preferred_blas_library("cublas")
        return F.linear(x, w, b)

    variants = {"torch": lambda: F.linear(x, w, b)}
    if cublas:
        variants["cublas"] = with_cublas
    for bn, bk, split in tiles:
        variants[f"triton {bn}x{bk}/s{split}"] = \
            lambda bn=bn, bk=bk, split=split: lin(x, w, b, bn, bk, split)
    times, cells = {}, []
    for name, fn in variants.items():
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(fn().float(), ref.float(), atol=tol, rtol=tol)
        times[name] = us = bench(fn)
        torch.backends.cuda.preferred_blas_library("default")
        cells.append(f"{name} {us:6.1f} ({w.numel() * w.element_size() / us / 1e6:4.2f})")
    print(f"M {M:3d} {K:4d}->{N:4d}: " + " | ".join(cells), flush=True)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,320")
    args = graph_bench.parse(ap, argv)
    if args is None:
        return 2
    import torch

    dev, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    # (K, N, uses per layer): the 1280 -> 1280 shape is attention out, cross q and cross out
    shapes = [(64, 48, 1), (48, 16, 3)] if args.dry_run else \
        [(k, n, 3 if (k, n) == (1280, 1280) else 1) for k, n in SHAPES]
    tiles = [(16, 32, 1), (16, 16, 2)] if args.dry_run else TILES
    rows = [3] if args.dry_run else [int(r) for r in args.rows.split(",")]
    lin = triton_linear()

    def bench(fn) -> float:
        return graph_bench.us_per_call(fn, args.dry_run)

    print(f"# decoder linears, {dtype}, one call replayed in a CUDA graph: us (weight TB/s)")
    for M in rows:
        per_layer: dict[str, float] = {}
        best = 0.0
        for K, N, uses in shapes:
            times = shape_row(M, K, N, dev, dtype, tiles, lin, bench, not args.dry_run)
            best += uses * min(times.values())
            for name, us in times.items():
                per_layer[name] = per_layer.get(name, 0.0) + uses * us
        ranked = sorted(per_layer, key=per_layer.get)
        print(f"# M {M}: one layer's 6 GEMMs, us: " + " | ".join(
            f"{n} {per_layer[n]:.1f}" for n in ranked[:4]) + f" | best per shape {best:.1f}",
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
