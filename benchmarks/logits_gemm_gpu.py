"""The vocabulary projection at decode rows: does the vocabulary's width cost cuBLAS its fast
kernels?

Whisper's multilingual vocabulary has 51,866 tokens (large-v3; 51,865 for the others): a row
of logits is not a multiple of 16 bytes, and a beam step's profile (wave 24) showed the logits
GEMM in an sm80 ``..._align2`` kernel (0.212 ms at 320 rows, ~200 TFLOP/s) where every other
GEMM of the step ran an sm90 one. Per rows M, one call replayed in a CUDA graph
(``graph_bench.us_per_call``), for:

* ``exact``: ``F.linear(x, w)`` with ``w`` ``[V, d]`` (the model today);
* ``padded P``: ``F.linear(x, w_pad)[:, :V]`` with ``w_pad`` ``[P, d]`` (``V`` rows of ``w``,
  then zeros): the same values, a strided view of an aligned output;
* ``padded P + copy``: the same made contiguous (what a consumer that needs it would pay);
* ``out= view``: ``torch.mm(x, w.t(), out=buf[:, :V])`` into a row-padded buffer (tried: cuBLAS
  still gets the unaligned width);
* ``engine``: ``edserve.models.vocab_projection.vocab_logits`` with the model's padded buffer
  (``pad_rows``; on the CPU and for an aligned vocabulary it is ``F.linear``).

Every variant is checked against ``exact`` first (bf16 tolerance; the largest difference is
printed: another kernel may sum in another order).

  python benchmarks/logits_gemm_gpu.py              # H200: ~20 s
  python benchmarks/logits_gemm_gpu.py --dry-run    # tiny shapes on CPU
"""

from __future__ import annotations

import argparse
import sys

import graph_bench


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,320")
    ap.add_argument("--vocab", type=int, default=51866)
    ap.add_argument("--d-model", type=int, default=1280)
    ap.add_argument("--pads", default="16,64", help="pad the vocabulary to multiples of these")
    args = graph_bench.parse(ap, argv)
    if args is None:
        return 2
    import torch
    import torch.nn.functional as F

    from edserve.models.vocab_projection import pad_rows, padded_width, vocab_logits

    dev, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    V, d = (101, 32) if args.dry_run else (args.vocab, args.d_model)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d ** 0.5).to(dev, dtype)
    padded = pad_rows(w)  # the model's buffer (align_vocabulary)
    print(f"# logits GEMM, vocabulary {V} x d {d}, {dtype}: us per call in a CUDA graph "
          f"(TFLOP/s)")
    for M in [3] if args.dry_run else [int(r) for r in args.rows.split(",")]:
        x = torch.randn(M, d, generator=g).to(dev, dtype)
        ref = F.linear(x, w)
        variants = {"exact": lambda x=x: F.linear(x, w)}
        for m in (int(p) for p in args.pads.split(",")):
            P = -(-V // m) * m
            w_pad = torch.zeros(P, d, dtype=dtype, device=dev)
            w_pad[:V] = w
            variants[f"padded {P}"] = lambda x=x, w_pad=w_pad: F.linear(x, w_pad)[:, :V]
            variants[f"padded {P} + copy"] = \
                lambda x=x, w_pad=w_pad: F.linear(x, w_pad)[:, :V].contiguous()
        width = padded_width(V, w.element_size()) or V
        out_buf = torch.empty(M, width, dtype=dtype, device=dev)
        variants["out= view"] = \
            lambda x=x, o=out_buf: torch.mm(x, w.t(), out=o[:, :V])
        variants["engine"] = (lambda x=x: vocab_logits(x, padded[:V], padded)) \
            if padded is not None else (lambda x=x: vocab_logits(x, w))
        cells = []
        for name, fn in variants.items():
            out = fn()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
            diff = (out.float() - ref.float()).abs().max().item()
            us = graph_bench.us_per_call(fn, args.dry_run)
            cells.append(f"{name} {us:6.1f} ({2 * M * V * d / us / 1e6:5.1f}; max diff {diff:.1e})")
        print(f"M {M:3d}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
