"""Bidirectional attention at an odd head dim: native vs zero-padded head dims, per SDPA backend.

Mllama's vision tower runs 16 heads of 80 (hidden 1280). Attention kernels are tuned for head
dims 64 / 128; flash rounds 80 up to 96 internally. Zero-padding q, k and v to a larger head
dim is exact (the extra q/k columns add 0 to every dot product, the extra v columns give 0
outputs that are sliced off; the scale stays 1/sqrt(80)). This script measures, for the
vision tower's attention shapes (4-tile images: 6432 keys; the grouped plan's two calls of a
1-tile image) and Whisper large-v3's encoder (20 x 64, 1500 tokens), each SDPA backend at the
native head dim and padded to 96 / 128: ms per call, useful TFLOP/s (FLOPs of the native head
dim) and the largest difference from the native call.

It also times edserve's Triton dense-attention kernel (`edserve/kernels/dense_attention.py`,
head dim 80 as 64 + 16 with no padding) over a sweep of tile shapes, and prints the best.

  python benchmarks/attn_headdim.py              # H200: ~2 minutes
  python benchmarks/attn_headdim.py --dry-run    # small shapes on CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F


def timed(fn, runs: int) -> float:
    """Median ms of ``runs`` calls after two warm-ups (CUDA events on GPU)."""
    fn(), fn()
    times = []
    for _ in range(runs):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def padded_sdpa(q, k, v, hd_to: int) -> torch.Tensor:
    """``sdpa(q, k, v)`` with q/k/v ``[N, H, L, hd]`` zero-padded to ``hd_to`` (exact)."""
    hd = q.shape[-1]
    if hd_to == hd:
        return F.scaled_dot_product_attention(q, k, v)
    pad = (0, hd_to - hd)
    o = F.scaled_dot_product_attention(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad),
                                       scale=hd ** -0.5)
    return o[..., :hd]


def backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend
    if not torch.cuda.is_available():
        return {"math": SDPBackend.MATH}
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def tile_sweep(dry_run: bool) -> list:
    """DenseTiles to try: (block_m, block_n, warps, stages) around the Triton tutorial's."""
    from edserve.kernels.dense_attention import DenseTiles

    if dry_run:
        return [DenseTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)]
    return [DenseTiles(bm, bn, w, st) for bm, bn, w, st in (
        (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
        (128, 32, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2), (128, 32, 4, 3), (64, 64, 4, 3),
        (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3), (64, 32, 4, 4), (256, 64, 8, 2),
        (256, 32, 8, 3))]


def triton_rows(name: str, q, k, v, ref, flops: float, runs: int, dry_run: bool) -> None:
    """The Triton kernel at every tile shape of the sweep; the best last. ref ``[N, Lq, H, hd]``."""
    from edserve.kernels.dense_attention import dense_attention

    best = None
    for t in tile_sweep(dry_run):
        try:
            out = dense_attention(q, k, v, tiles=t)  # [N, Lq, H, hd]
            ms = timed(lambda t=t: dense_attention(q, k, v, tiles=t), runs)
        except Exception as e:  # noqa: BLE001 (out of shared memory / registers: skip it)
            print(f"{name:24} triton {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
                  f"   n/a ({str(e).splitlines()[0][:50]})")
            continue
        diff = (out.float() - ref).abs().max().item()
        label = f"triton {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
        print(f"{name:24} {label:26} {ms:9.3f} {flops / ms / 1e9:8.1f} {diff:9.2e}",
              flush=True)
        if best is None or ms < best[0]:
            best = (ms, label)
    if best:
        print(f"{name:24} BEST {best[1]:21} {best[0]:9.3f} {flops / best[0] / 1e9:8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="small shapes on CPU")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--images", type=int, default=4, help="vision batch (images per call)")
    args = ap.parse_args(argv)
    from torch.nn.attention import sdpa_kernel

    dev = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    s = 1 if dev == "cuda" else 16  # shrink sequence lengths on CPU
    n = args.images if dev == "cuda" else 1
    # (name, batch, heads, query len, key len, head dim, padded head dims)
    shapes = [
        ("vision 4-tile, all", n, 16, 6432 // s, 6432 // s, 80, (80, 96, 128)),
        ("vision 1-tile, real q", n, 16, 1601 // s, 6432 // s, 80, (80, 96, 128)),
        ("vision 1-tile, pad q", n, 16, 4831 // s, 1601 // s, 80, (80, 96, 128)),
        ("whisper v3 encoder", 16 if dev == "cuda" else 1, 20, 1500 // s, 1500 // s, 64,
         (64, 128)),
    ]
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# device {dev} dtype {dt} runs {args.runs}")
    print(f"{'shape':24} {'backend':10} {'hd':>4} {'ms':>9} {'TFLOP/s':>8} {'max diff':>9}")
    for name, N, H, Lq, Lk, hd, pads in shapes:
        q = torch.randn(N, H, Lq, hd, generator=g, device=dev, dtype=dt)
        k = torch.randn(N, H, Lk, hd, generator=g, device=dev, dtype=dt)
        v = torch.randn(N, H, Lk, hd, generator=g, device=dev, dtype=dt)
        flops = 4 * N * H * Lq * Lk * hd
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for bname, backend in backends().items():
            for to in pads:
                try:
                    with sdpa_kernel([backend]):
                        out = padded_sdpa(q, k, v, to)
                        ms = timed(lambda: padded_sdpa(q, k, v, to), args.runs)  # noqa: B023
                except RuntimeError as e:
                    print(f"{name:24} {bname:10} {to:>4}   n/a ({str(e).splitlines()[0][:60]})")
                    continue
                diff = (out.float() - ref).abs().max().item()
                print(f"{name:24} {bname:10} {to:>4} {ms:9.3f} {flops / ms / 1e9:8.1f} "
                      f"{diff:9.2e}", flush=True)
        if dev == "cpu":  # the Triton interpreter: one head and 32 queries are enough
            q, k, v, ref = q[:, :1, :32], k[:, :1], v[:, :1], ref[:, :1, :32]
            flops *= 32 / (H * Lq)
        triton_rows(name, q, k, v, ref.transpose(1, 2), flops, args.runs, dev == "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
