"""Decode cross-attention (edserve.kernels.grouped_cross_attention) on the GPU at Whisper
large-v3's shape: 20 heads x 64, 1500 encoder keys per row, greedy rows (groups of one in the
engine's [B, 16] group table), keys by token (flat) and by 128-slot page (aligned), a bf16 or
fp8 pool; the grid's two orders (heads first / groups first) and the memory floor at the
measured copy rate. One call reads every row's whole encoder K and V once.

  python benchmarks/cross_decode_gpu.py            # H200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edserve.config import MAX_GROUP_ROWS  # noqa: E402
from edserve.kernels.grouped_cross_attention import grouped_cross_attention  # noqa: E402

H, D, KEYS, PAGE = 20, 64, 1500, 128


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1000


def case(B: int, kv_dtype: torch.dtype, seed: int = 0) -> dict:
    """B rows, each with KEYS keys on its own pages (pages shuffled over the pool)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = -(-KEYS // PAGE) + 4  # + the decoder's pages
    num_pages = B * pages_per_row + 1
    k = (torch.randn(num_pages * PAGE, H, D, device="cuda") * 0.5).to(kv_dtype)
    v = (torch.randn(num_pages * PAGE, H, D, device="cuda") * 0.5).to(kv_dtype)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).view(B, pages_per_row)
    table = perm.to("cuda")  # [B, pages_per_row]
    r2t = (perm[:, :, None] * PAGE + torch.arange(PAGE)).reshape(B, -1).to(torch.int32)
    group_rows = torch.full((B, MAX_GROUP_ROWS), -1, dtype=torch.int32)
    group_rows[:, 0] = torch.arange(B)
    return dict(q=torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16), k=k, v=v,
                table=table, r2t=r2t.to("cuda"), pool=torch.arange(B, device="cuda"),
                groups=group_rows.to("cuda"),
                kv_lens=torch.full((B,), KEYS, dtype=torch.int32, device="cuda"))


def call(c: dict, by_page: bool, heads_first: bool, num_splits: int | None = None):
    addr = dict(page_table=c["table"], page_size=PAGE) if by_page else \
        dict(req_to_token=c["r2t"], req_pool_indices=c["pool"])
    out = torch.empty_like(c["q"])
    return lambda: grouped_cross_attention(c["q"], c["k"], c["v"], c["groups"], c["kv_lens"],
                                           D ** -0.5, out=out, heads_first=heads_first,
                                           num_splits=num_splits, **addr)


def sweep_splits(batches: list[int], splits: list[int], rate: float) -> None:
    """bf16, heads first: microseconds (TB/s) per split-KV factor against the automatic one
    (the same outputs within bf16 rounding of the split's combine)."""
    print("\n# split-KV sweep (bf16, heads first): us (TB/s) per factor; auto = the shape rule")
    print("keys by   B   floor us   auto us   " + "   ".join(f"split {n:2d}" for n in splits))
    for B in batches:
        c = case(B, torch.bfloat16)
        nbytes = B * KEYS * H * D * 2 * c["k"].element_size()
        for by_page in (False, True):
            auto = call(c, by_page, True)
            want = auto()
            cells = []
            for n in splits:
                fn = call(c, by_page, True, n)
                torch.testing.assert_close(fn(), want, rtol=2e-2, atol=2e-2)
                t = us(fn)
                cells.append(f"{t:6.1f} ({nbytes / t / 1e6:4.2f})")
            print(f"{'page' if by_page else 'token':7s} {B:3d}   {nbytes / rate / 1e6:8.1f}   "
                  f"{us(auto):7.1f}   " + "   ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--splits", type=int, nargs="*", default=None,
                    help="only the split-KV sweep: these factors at every --batch")
    args = ap.parse_args()
    big = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    rate = 2 * big.numel() / (us(lambda b=big: b.clone()) * 1e-6) / 1e12  # TB/s, read + write
    del big
    print(f"# {torch.cuda.get_device_name()}: copy rate {rate:.2f} TB/s; {H} heads x {D}, "
          f"{KEYS} keys per row, greedy rows")
    if args.splits:
        sweep_splits(args.batch, args.splits, rate)
        return
    print("kv     keys by   B   floor us   heads-first us (TB/s)   groups-first us (TB/s)")
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for B in args.batch:
            c = case(B, kv_dtype)
            nbytes = B * KEYS * H * D * 2 * c["k"].element_size()
            for by_page in (False, True):
                fns = [call(c, by_page, hf) for hf in (True, False)]
                a, b = fns[0](), fns[1]()
                assert torch.equal(a, b), "grid orders disagree"
                t = [us(f) for f in fns]
                print(f"{str(kv_dtype).split('.')[1]:6s} {'page' if by_page else 'token':7s} "
                      f"{B:3d}   {nbytes / rate / 1e6:8.1f}   "
                      + "   ".join(f"{x:12.1f} ({nbytes / x / 1e6:4.2f})" for x in t))


if __name__ == "__main__":
    main()
