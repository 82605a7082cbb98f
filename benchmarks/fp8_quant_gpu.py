"""The fp8 encoder's activation scaling (edserve.kernels.fp8_quant) on the GPU: every launch
shape (rows per program x warps) for the large-v3 encoder's four inputs at a 16-clip prefill
(24,000 tokens), against the torch ops it replaced, with the memory floor (one bf16 read, one
fp8 write) at the measured copy rate.

  python benchmarks/fp8_quant_gpu.py            # H200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edserve.kernels.fp8_quant import launch_shape, quantize_rows_fp8  # noqa: E402
from edserve.models.fp8 import quantize_rows  # noqa: E402

CASES = [(1280, None, "qkv / out_proj / fc1 input"), (5120, "tanh", "fc2 input, tanh GELU"),
         (5120, "exact", "fc2 input, erf GELU")]


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24000)
    args = ap.parse_args()
    M = args.tokens
    big = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    copy_rate = 2 * big.numel() / (us(lambda: big.clone()) * 1e-6) / 1e12  # TB/s, read + write
    print(f"# {torch.cuda.get_device_name()}, {M} tokens; copy rate {copy_rate:.2f} TB/s")
    for K, gelu, what in CASES:
        x = (torch.randn(M, K, device="cuda") * 3).to(torch.bfloat16)
        floor = M * K * 3 / (copy_rate * 1e12) * 1e6  # us: bf16 in, fp8 out
        block, r0, w0 = launch_shape(K)
        if gelu is None:
            torch_us = us(lambda x=x: quantize_rows(x))
        else:
            approx = "none" if gelu == "exact" else "tanh"
            torch_us = us(lambda x=x, a=approx: quantize_rows(F.gelu(x, approximate=a)))
        print(f"\n## K={K} ({what}): floor {floor:.1f} us; torch ops {torch_us:.1f} us; "
              f"default rows={r0} warps={w0}")
        print("rows  warps      us   x floor  TB/s")
        for rows in (1, 2, 4, 8, 16):
            if rows * block > 16384:
                continue
            for warps in (2, 4, 8, 16):
                if warps * 32 > rows * block:
                    continue
                t = us(lambda x=x, g=gelu, r=rows, w=warps: quantize_rows_fp8(
                    x, g, rows=r, num_warps=w))
                mark = "  <- default" if (rows, warps) == (r0, w0) else ""
                print(f"{rows:4d}  {warps:5d}  {t:6.1f}  {t / floor:8.2f}  "
                      f"{M * K * 3 / (t * 1e-6) / 1e12:4.2f}{mark}")


if __name__ == "__main__":
    main()
