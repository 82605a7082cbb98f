"""The encoders' attention: cuDNN (SDPA) vs edserve's Triton kernels, TMA tiles swept, and
FlashAttention-3 where ``EDSERVE_FA3_LIB`` names its library (tools/build_fa3.sh).

Large-v3's encoder runs 20 heads of 64 over 1500 tokens, the 11B vision tower 16 heads of 80
over 6432-token images (its grouped plan's two calls per image group); q/k/v are strided views
of a fused qkv tensor (``[N, L, 3, H, hd]`` permuted to ``[N, H, L, hd]``), as the layers call
attention. Per backend: ms per call (median of back-to-back calls timed by CUDA events, and the
same call replayed from a CUDA graph), useful TFLOP/s (``4 N H S^2 hd``), the host's ms per
eager call, and the largest difference from a float64 reference on the first two batch items.

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


def sweep(dry_run: bool, hd: int) -> list:
    from edserve.kernels.tma_attention import TmaTiles

    if dry_run:
        return [TmaTiles(32, 16, 4, 2)]
    # (block_m, block_n, warps, stages): wave 38's sweeps (H100, H200) found 128-key blocks with
    # 8 warps, 32-key blocks and 256-row blocks slower at every shape
    return [TmaTiles(*c) for c in (
        (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3))]


# (name, batch, heads, query rows [a, b) of L, key rows [0, k) of L, L, head dim): the Whisper
# large-v3 encoder (20 x 64, 1500 tokens) and the 11B vision tower's grouped plan (16 x 80; a
# 4-tile image is 6432 tokens; a 1-tile image's 1601 real queries see all 6432 keys, its 4831
# padding queries the 1601 real keys), q/k/v as views of one fused qkv tensor
SHAPES = {
    "whisper": [("whisper v3", n, 20, (0, 1500), 1500, 1500, 64) for n in (16, 64)],
    "vision": [("vision 4-tile", 16, 16, (0, 6432), 6432, 6432, 80),
               ("vision 1-tile real q", 16, 16, (0, 1601), 6432, 6432, 80),
               ("vision 1-tile pad q", 16, 16, (1601, 6432), 1601, 6432, 80)],
}
DRY = [("dry", 2, 2, (3, 70), 37, 70, 64), ("dry hd80", 1, 2, (0, 40), 40, 40, 80)]


def run_shape(shape: tuple, dev: str, g: torch.Generator, runs: int) -> None:
    """Every kernel at one shape: a table row each, the best TMA tiles last."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from edserve.kernels.dense_attention import dense_attention
    from edserve.kernels.fa3_attention import fa3_attention, fa3_unsupported
    from edserve.kernels.tma_attention import tma_attention

    name, N, H, (qa, qb), nk, L, hd = shape
    qkv = torch.randn(N, L, 3, H, hd, generator=g, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [N, H, L, hd] views
    q, k, v = q[:, :, qa:qb], k[:, :, :nk], v[:, :, :nk]
    r = 1 if nk * (qb - qa) > 4e7 else min(N, 2)  # the float64 scores of r items fit
    ref = F.scaled_dot_product_attention(q[:r].double(), k[:r].double(), v[:r].double())
    ref = ref.transpose(1, 2)  # [r, Lq, H, hd]
    flops = 4 * N * H * (qb - qa) * nk * hd
    out = torch.empty(N, qb - qa, H, hd, device=dev, dtype=torch.bfloat16)

    def sdpa(backend):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    rows = []
    if dev == "cuda":
        rows += [("sdpa cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("sdpa flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION))]
    rows.append(("dense (pointer loads)", lambda: dense_attention(q, k, v, out=out)))
    if dev == "cuda" and fa3_unsupported(q.device, q.dtype, hd) is None:
        rows.append(("fa3 (FlashAttention-3)", lambda: fa3_attention(q, k, v, out=out)))
    for t in sweep(dev != "cuda", hd):
        label = f"tma {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
        rows.append((label, lambda t=t: tma_attention(q, k, v, out=out, tiles=t)))
    best = None
    for label, fn in rows:
        try:
            o = fn()
            diff = (o[:r].double() - ref).abs().max().item()
            if dev == "cuda":
                ms, gms = device_ms(fn, runs, False), device_ms(fn, runs, True)
                hms = host_ms(fn, 20)
            else:
                ms = gms = hms = float("nan")
        except Exception as e:  # noqa: BLE001 (a tile shape out of shared memory: skip it)
            print(f"{name:20} {N:>3} {label:24} n/a ({str(e).splitlines()[0][:70]})",
                  flush=True)
            continue
        print(f"{name:20} {N:>3} {label:24} {ms:8.3f} {gms:8.3f} {flops / gms / 1e9:8.1f} "
              f"{hms:8.3f} {diff:9.2e}", flush=True)
        if label.startswith("tma") and (best is None or gms < best[0]):
            best = (gms, label)
    if best:
        print(f"{name:20} {N:>3} BEST {best[1]:19} {'':8} {best[0]:8.3f} "
              f"{flops / best[0] / 1e9:8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="small shapes on the CPU interpreter")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, bf16; ms: back to back, graph ms: replayed "
          f"(TFLOP/s from it), host ms: per eager call")
    print(f"{'shape':20} {'N':>3} {'kernel':24} {'ms':>8} {'graph ms':>8} {'TFLOP/s':>8} "
          f"{'host ms':>8} {'max diff':>9}")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = DRY if dev != "cuda" else [s for k in args.shapes for s in SHAPES[k]]
    for shape in shapes:
        run_shape(shape, dev, g, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
