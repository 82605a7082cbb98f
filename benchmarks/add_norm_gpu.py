"""Residual add + LayerNorm on the GPU: the fused Triton kernel (``edserve.kernels.add_norm``)
vs the torch ops it replaces in the encoders (``x + delta`` then ``nn.LayerNorm``; gated:
``x + tanh(g) * delta``), and a plain LayerNorm, per row shape.

Each line: median time (``triton.testing.do_bench``), achieved bandwidth (bytes the op must
move: fused = read x, delta + write new x, normed; torch = what its separate kernels move)
as a fraction of a measured device-to-device copy, the normed output's relative error vs
float64, and whether the new residual equals torch's bit for bit.

    python benchmarks/add_norm_gpu.py                      # H200: Whisper large-v3 rows
    python benchmarks/add_norm_gpu.py --rows 24000 48000 --dims 1280 384
    python benchmarks/add_norm_gpu.py --sweep              # + the kernel's launch shapes
    python benchmarks/add_norm_gpu.py --dry-run            # CPU: tiny sizes, interpreter

``--sweep`` also times the raw kernel (plain add) at every (rows per program, num_warps)
pair, to tune ``ROW_ELEMENTS`` and the warp count of :mod:`edserve.kernels.add_norm`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16 * 1500, 32 * 1500])
    p.add_argument("--dims", type=int, nargs="+", default=[1280, 384])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sweep", action="store_true", help="time the kernel's launch shapes")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (interpreter)")
    args = p.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is imported
        args.rows, args.dims = [6], [80]
    import kernel_timing as kt
    import torch

    from edserve.layers.add_norm import TORCH_ADD_NORM, TRITON_ADD_NORM

    dev = torch.device("cpu" if args.dry_run else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --dry-run on CPU")
    dtype = getattr(torch, args.dtype)

    def bench(fn) -> float:
        return kt.median_ms(fn, dev, rep=50)

    copy_gbs = kt.copy_gbs(dev, bench, args.dry_run)
    print(f"device: {kt.device_label(dev)}; "
          f"{args.dtype}; d2d copy {copy_gbs:.0f} GB/s (read+write)")
    print(f"{'rows':>6} {'d':>5} {'op':24} {'time_us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'rel_err':>9} {'x==torch':>8}")
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        for R in args.rows:
            for d in args.dims:
                x = torch.randn(R, d, generator=gen, device=dev, dtype=dtype)
                delta = torch.randn(R, d, generator=gen, device=dev, dtype=dtype)
                norm = torch.nn.LayerNorm(d, device=dev, dtype=dtype)
                norm.weight.uniform_(0.5, 1.5, generator=gen)
                norm.bias.normal_(generator=gen)
                gate = torch.tensor([0.9], device=dev, dtype=dtype).tanh()
                row = R * d * x.element_size()  # bytes of one [R, d] pass
                cases = [  # name, fn, delta, gate, bytes moved
                    ("torch add+LN", TORCH_ADD_NORM, delta, None, 5 * row),
                    ("triton add+LN", TRITON_ADD_NORM, delta, None, 4 * row),
                    ("torch gated add+LN", TORCH_ADD_NORM, delta, gate, 7 * row),
                    ("triton gated add+LN", TRITON_ADD_NORM, delta, gate, 4 * row),
                    ("torch LN", TORCH_ADD_NORM, None, None, 2 * row),
                    ("triton LN", TRITON_ADD_NORM, None, None, 2 * row)]
                want = {}
                for name, ops, dl, g, moved in cases:
                    new_x, h = ops.add_layer_norm(norm, x, dl, g)
                    ref = ref64(torch, new_x, norm)
                    err = float((h.double() - ref).norm() / ref.norm())
                    key = (dl is None, g is None)
                    same = want.setdefault(key, new_x)
                    ms = bench(functools.partial(ops.add_layer_norm, norm, x, dl, g))
                    gbs = moved / ms / 1e6
                    print(f"{R:6d} {d:5d} {name:24} {ms * 1e3:9.1f} {gbs:7.0f} "
                          f"{100 * gbs / copy_gbs:5.0f}% {err:9.2e} "
                          f"{str(torch.equal(new_x, same)):>8}", flush=True)
                if args.sweep:
                    sweep(bench, x, delta, norm, copy_gbs, [1, 2] if args.dry_run
                          else [1, 2, 4, 8], [1, 2] if args.dry_run else [2, 4, 8, 16])
    return 0


def sweep(bench, x, delta, norm, copy_gbs, rows_options, warps_options) -> None:
    """The raw kernel (add + LN, no gate) at each rows-per-program and warp count."""
    import triton

    from edserve.kernels.add_norm import _add_layer_norm_kernel

    R, N = x.shape
    new_x, out = x.new_empty(R, N), x.new_empty(R, N)
    block = triton.next_power_of_2(N)
    for rows in rows_options:
        for warps in warps_options:
            def launch(rows=rows, warps=warps):
                _add_layer_norm_kernel[(triton.cdiv(R, rows),)](
                    x, delta, x, norm.weight, norm.bias, new_x, out, N, N, N, N, R, N,
                    norm.eps, HAS_DELTA=True, HAS_GATE=False, HAS_W=True, HAS_B=True,
                    ROWS=rows, BLOCK=block, num_warps=warps)
            ms = bench(launch)
            gbs = 4 * x.numel() * x.element_size() / ms / 1e6
            print(f"{R:6d} {N:5d}   kernel rows={rows} warps={warps:<2d}  {ms * 1e3:9.1f} "
                  f"{gbs:7.0f} {100 * gbs / copy_gbs:5.0f}%", flush=True)


def ref64(torch, new_x, norm):
    """float64 LayerNorm of the (rounded) new residual."""
    n = new_x.double()
    mean = n.mean(-1, keepdim=True)
    var = (n - mean).pow(2).mean(-1, keepdim=True)
    return (n - mean) / torch.sqrt(var + norm.eps) * norm.weight.double() + norm.bias.double()


if __name__ == "__main__":
    sys.exit(main())
