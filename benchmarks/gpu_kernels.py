"""Attention kernels on the GPU: correctness vs float64 and speed vs copy bandwidth.

Workloads are Whisper decoder steps: cross-attention over 1500 encoder keys and decoder
self-attention over ~100 keys (decode; plus one prefill-like extend), for tiny (6 heads) and
large-v3 (20 heads), head_dim 64, batch 1/16/64/256, bf16 and fp32. Layouts:

* ``flat/ps1``, ``flat/ps128`` - :func:`flat_attention` over a pool of page size 1 / 128
  (token-granular rows, encoder region of exactly 1500 slots);
* ``paged/ps16``, ``paged/ps128`` - :func:`paged_attention` with the aligned layout (encoder
  region rounded up to whole pages);
* ``ragged`` - gather each request's encoder K/V into a contiguous buffer, then
  ``torch.nn.attention.varlen.varlen_attn`` (bf16 only; time = gather + attention).

Each line prints the relative error vs the float64 torch reference, the median time
(``triton.testing.do_bench``), and the achieved K/V read bandwidth as a fraction of a measured
device-to-device copy (read + write bytes / time).

    python benchmarks/gpu_kernels.py                 # H200: < 5 minutes
    python benchmarks/gpu_kernels.py --dry-run       # CPU: tiny sizes, Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
import time

MODELS = {"tiny": 6, "large-v3": 20}  # decoder heads (= kv heads); head_dim 64
LAYOUTS = (("flat", 1), ("flat", 128), ("paged", 16), ("paged", 128))
TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (interpreter)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new cases after")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    import kernel_timing as kt
    import torch

    from edserve.kernels.flat_attention import flat_attention
    from edserve.kernels.paged_attention import paged_attention
    from edserve.layers.attention import torch_ops

    dev = torch.device("cpu" if args.dry_run else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --dry-run on CPU")
    enc_len, dec_len, head_dim = (150, 12, 64) if args.dry_run else (1500, 100, 64)
    batches = [1, 3] if args.dry_run else args.batches
    models = args.models[:1] if args.dry_run else args.models
    heads = {m: (2 if args.dry_run else MODELS[m]) for m in models}
    scale = head_dim ** -0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def bench(fn) -> float:
        return kt.median_ms(fn, dev, rep=40)

    copy_gbs = kt.copy_gbs(dev, bench, args.dry_run)
    print(f"device: {kt.device_label(dev)}; "
          f"d2d copy {copy_gbs:.0f} GB/s (read+write)")
    print(f"{'model':9} {'dtype':9} {'B':>4} {'layout':12} {'work':13} {'rel_err':>9} "
          f"{'time_us':>9} {'GB/s':>7} {'%copy':>6}")

    t_start = time.time()
    failures = 0

    def report(model, dtype, B, layout, work, err, ms, kv_bytes, tol):
        nonlocal failures
        bad = not (err <= tol)
        failures += bad
        gbs = kv_bytes / ms / 1e6
        print(f"{model:9} {str(dtype)[6:]:9} {B:4d} {layout:12} {work:13} {err:9.2e} "
              f"{ms * 1e3:9.1f} {gbs:7.0f} {100 * gbs / copy_gbs:5.0f}%{'  BAD' if bad else ''}",
              flush=True)

    def rel_err(out, ref) -> float:
        return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))

    for model, H in heads.items():
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            for B in batches:
                if time.time() - t_start > args.budget_s:
                    print(f"time budget {args.budget_s:.0f}s spent; skipping the rest")
                    return 1 if failures else 0
                dec = torch.randint(dec_len * 2 // 3, dec_len * 4 // 3, (B,), generator=gen,
                                    device=dev).int()
                q1 = torch.randn(B, H, head_dim, generator=gen, device=dev, dtype=dtype)
                cu1 = torch.arange(B + 1, device=dev, dtype=torch.int32)
                qe = torch.randn(int(dec.sum()), H, head_dim, generator=gen, device=dev,
                                 dtype=dtype)
                cue = torch.nn.functional.pad(dec.cumsum(0), (1, 0)).int()
                enc = torch.full((B,), enc_len, device=dev, dtype=torch.int32)
                works = [("cross-decode", q1, cu1, 1, False, enc),
                         ("self-decode", q1, cu1, 1, True, dec)]
                if B == batches[min(1, len(batches) - 1)]:
                    works.append(("self-extend", qe, cue, int(dec.max()), True, dec))
                for kind, ps in LAYOUTS:
                    region = -(-enc_len // ps) * ps if kind == "paged" else enc_len
                    row = region + int(dec.max())
                    per_row = -(-row // ps)
                    pages = (torch.randperm(B * per_row, generator=gen, device=dev) + 1)
                    pages = pages.view(B, per_row)  # page 0 = padding
                    pos = torch.arange(per_row * ps, device=dev)
                    r2t = (pages[:, pos // ps] * ps + pos % ps).int()  # [B, cols]
                    pool = (B * per_row + 1) * ps
                    k = torch.randn(pool, H, head_dim, generator=gen, device=dev, dtype=dtype)
                    v = torch.randn_like(k)
                    kd, vd = k.double(), v.double()
                    rows = torch.arange(B, device=dev)
                    for work, q, cu, max_q, causal, lens in works:
                        start = 0 if work.startswith("cross") else region
                        starts = torch.full((B,), start, device=dev, dtype=torch.int32)
                        out = torch.empty_like(q)
                        if kind == "flat":
                            a = (r2t, rows, starts, lens, cu, max_q, causal, scale)
                            ref = torch_ops.flat_attention(q.double(), kd, vd, *a)
                            fn = lambda a=a, q=q, k=k, v=v, out=out: flat_attention(q, k, v, *a,
                                                                               out=out)
                        else:
                            a = (pages.int(), starts // ps, lens, cu, max_q, causal, scale, ps)
                            ref = torch_ops.paged_attention(q.double(), kd, vd, *a)
                            fn = lambda a=a, q=q, k=k, v=v, out=out: paged_attention(q, k, v, *a,
                                                                                out=out)
                        err = rel_err(fn(), ref)
                        kv_bytes = 2 * int(lens.sum()) * H * head_dim * k.element_size()
                        report(model, dtype, B, f"{kind}/ps{ps}", work, err, bench(fn),
                               kv_bytes, TOL[dname])
                    if kind == "flat" and ps == 1:
                        ragged(torch, torch_ops, report, bench, rel_err, model, dtype, B, q1,
                               cu1, k, v, kd, vd, r2t[:, :enc_len], enc_len, scale)
                    del k, v, kd, vd
    print(f"done in {time.time() - t_start:.0f}s; {failures} case(s) over tolerance")
    return 1 if failures else 0


def ragged(torch, torch_ops, report, bench, rel_err, model, dtype, B, q, cu_q, k, v, kd, vd,
           enc_slots, enc_len, scale) -> None:
    """The ragged strategy for cross-attention decode: gather the encoder K/V, then varlen."""
    idx = enc_slots.reshape(-1).long()  # [B * enc_len] slots, request-major
    cu_k = torch.arange(B + 1, device=q.device, dtype=torch.int32) * enc_len
    ref = torch_ops.varlen_attention(q.double(), kd[idx], vd[idx], cu_q, cu_k, 1, enc_len,
                                     False, scale)
    name = "varlen_attn"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is None or not q.is_cuda or dtype == torch.float32:
        if q.is_cuda:  # the fused kernel is flash attention: 16-bit only
            print(f"{model:9} {str(dtype)[6:]:9} {B:4d} ragged       (varlen_attn: 16-bit only)")
            return
        name = "torch_ops"  # dry run: exercise the path with the reference

        def attn(q, kg, vg):
            return torch_ops.varlen_attention(q, kg, vg, cu_q, cu_k, 1, enc_len, False, scale)
    else:

        def attn(q, kg, vg):
            try:
                return varlen_attn(q, kg, vg, cu_q, cu_k, 1, enc_len, scale=scale,
                                   window_size=(-1, -1))
            except TypeError:  # torch without window_size: non-causal by default
                return varlen_attn(q, kg, vg, cu_q, cu_k, 1, enc_len, scale=scale)

    def gathered():
        return attn(q, k.index_select(0, idx), v.index_select(0, idx))

    try:
        err = rel_err(gathered(), ref)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"ragged/{name} failed: {type(e).__name__}: {e}")
        return
    kv_bytes = 2 * idx.numel() * k.shape[1] * k.shape[2] * k.element_size()
    kg, vg = k.index_select(0, idx), v.index_select(0, idx)
    report(model, dtype, B, "ragged", "cross+gather", err, bench(gathered), kv_bytes, 2e-2)
    report(model, dtype, B, "ragged", "cross-attn", err, bench(lambda: attn(q, kg, vg)),
           kv_bytes, 2e-2)


if __name__ == "__main__":
    sys.exit(main())
