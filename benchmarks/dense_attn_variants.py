"""Head dim 80 on the H200's tensor cores: which split of the dots is fastest (an experiment).

`edserve/kernels/dense_attention.py` cuts head dim 80 into 64 + 16 for both dots (q k^T: two
dots of K = 64 and 16; p v: two of N = 64 and 16). A 16-wide output (wgmma n16) may use the
tensor cores poorly, so this times, for the Mllama vision shapes, the four ways to lay out the
two dots: each split 64 + 16, or one dot over 128 zero-padded columns (masked loads, exact).
Same online softmax as the library kernel; each variant is checked against SDPA and swept
over a few tile shapes.

  python benchmarks/dense_attn_variants.py            # H200, ~2 minutes
  TRITON_INTERPRET=1 python benchmarks/dense_attn_variants.py --dry-run  # tiny, on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_headdim import timed  # noqa: E402

from edserve.kernels.common import LOG2E  # noqa: E402


@triton.jit
def _block(q_a, q_b, q_w, k_base, v_base, j, jm, s_kn, s_vn, m, lsum, acc_a, acc_b, acc_w,
           qk_scale, MASK_J: tl.constexpr, QK_WIDE: tl.constexpr, PV_WIDE: tl.constexpr):
    d64 = tl.arange(0, 64)
    d16 = 64 + tl.arange(0, 16)
    d128 = tl.arange(0, 128)
    w_ok = d128 < 80
    jmask = jm if MASK_J else j >= 0
    if QK_WIDE:
        kt = tl.load(k_base + j[None, :] * s_kn + d128[:, None],
                     mask=jmask[None, :] & w_ok[:, None], other=0.0)
        s = tl.dot(q_w, kt)
    else:
        if MASK_J:
            ka = tl.load(k_base + j[None, :] * s_kn + d64[:, None], mask=jm[None, :], other=0.0)
            kb = tl.load(k_base + j[None, :] * s_kn + d16[:, None], mask=jm[None, :], other=0.0)
        else:
            ka = tl.load(k_base + j[None, :] * s_kn + d64[:, None])
            kb = tl.load(k_base + j[None, :] * s_kn + d16[:, None])
        s = tl.dot(q_a, ka)
        s = tl.dot(q_b, kb, s)
    s = s * qk_scale
    if MASK_J:
        s = s + tl.where(jm, 0.0, float("-inf"))[None, :]
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    p = p.to(q_a.dtype)
    if PV_WIDE:
        v = tl.load(v_base + j[:, None] * s_vn + d128[None, :],
                    mask=jmask[:, None] & w_ok[None, :], other=0.0)
        acc_w = tl.dot(p, v, acc_w * alpha[:, None])
    else:
        if MASK_J:
            va = tl.load(v_base + j[:, None] * s_vn + d64[None, :], mask=jm[:, None], other=0.0)
            vb = tl.load(v_base + j[:, None] * s_vn + d16[None, :], mask=jm[:, None], other=0.0)
        else:
            va = tl.load(v_base + j[:, None] * s_vn + d64[None, :])
            vb = tl.load(v_base + j[:, None] * s_vn + d16[None, :])
        acc_a = tl.dot(p, va, acc_a * alpha[:, None])
        acc_b = tl.dot(p, vb, acc_b * alpha[:, None])
    return m_new, lsum, acc_a, acc_b, acc_w


@triton.jit
def _variant_kernel(Q, K, V, Out, s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob,
                    s_oh, s_om, H, Lq, Lk, qk_scale, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, QK_WIDE: tl.constexpr, PV_WIDE: tl.constexpr):
    mblk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < Lq
    d64 = tl.arange(0, 64)
    d16 = 64 + tl.arange(0, 16)
    d128 = tl.arange(0, 128)
    w_ok = d128 < 80
    q_ptr = Q + b * s_qb + h * s_qh + rows[:, None].to(tl.int64) * s_qm
    q_a = tl.load(q_ptr + d64[None, :], mask=rmask[:, None], other=0.0)
    q_b = tl.load(q_ptr + d16[None, :], mask=rmask[:, None], other=0.0)
    q_w = tl.load(q_ptr + d128[None, :], mask=rmask[:, None] & w_ok[None, :], other=0.0)
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    n_full = Lk // BLOCK_N
    for nb in range(0, n_full):
        j = (nb * BLOCK_N + cols).to(tl.int64)
        m, lsum, acc_a, acc_b, acc_w = _block(q_a, q_b, q_w, k_base, v_base, j, j < Lk, s_kn,
                                              s_vn, m, lsum, acc_a, acc_b, acc_w, qk_scale,
                                              False, QK_WIDE, PV_WIDE)
    if n_full * BLOCK_N < Lk:
        j = (n_full * BLOCK_N + cols).to(tl.int64)
        m, lsum, acc_a, acc_b, acc_w = _block(q_a, q_b, q_w, k_base, v_base, j, j < Lk, s_kn,
                                              s_vn, m, lsum, acc_a, acc_b, acc_w, qk_scale,
                                              True, QK_WIDE, PV_WIDE)
    inv = 1.0 / tl.where(lsum == 0.0, 1.0, lsum)
    o_ptr = Out + b * s_ob + h * s_oh + rows[:, None].to(tl.int64) * s_om
    if PV_WIDE:
        tl.store(o_ptr + d128[None, :], (acc_w * inv[:, None]).to(Out.dtype.element_ty),
                 mask=rmask[:, None] & w_ok[None, :])
    else:
        tl.store(o_ptr + d64[None, :], (acc_a * inv[:, None]).to(Out.dtype.element_ty),
                 mask=rmask[:, None])
        tl.store(o_ptr + d16[None, :], (acc_b * inv[:, None]).to(Out.dtype.element_ty),
                 mask=rmask[:, None])


def variant(q, k, v, qk_wide: bool, pv_wide: bool, bm: int, bn: int, warps: int,
            stages: int) -> torch.Tensor:
    """q ``[B, H, Lq, 80]``, k/v ``[B, H, Lk, 80]`` -> ``[B, Lq, H, 80]``."""
    B, H, Lq, D = q.shape
    assert D == 80
    out = torch.empty(B, Lq, H, D, dtype=q.dtype, device=q.device)
    _variant_kernel[(triton.cdiv(Lq, bm), B * H)](
        q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], out.stride(0),
        out.stride(2), out.stride(1), H, Lq, k.shape[2], D ** -0.5 * LOG2E, BLOCK_M=bm,
        BLOCK_N=bn, QK_WIDE=qk_wide, PV_WIDE=pv_wide, num_warps=warps, num_stages=stages)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--images", type=int, default=16, help="images per call (the engine's "
                    "groups at 64 image requests hold ~16)")
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run runs the Triton interpreter: set TRITON_INTERPRET=1")
    dev, dt = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    n, H, s = (1, 1, 64) if dry else (args.images, 16, 1)
    shapes = [("4-tile real q", 6404 // s, 6432 // s), ("1-tile real q", 1601 // s, 6432 // s),
              ("1-tile pad q", 4831 // s, 1601 // s)]
    tiles = [(16, 16, 4, 1)] if dry else [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
                                          (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 2)]
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# {dev} {dt}, {n} images x {H} heads x head dim 80, median of {args.runs}")
    print(f"{'shape':16} {'qk':5} {'pv':5} {'tiles':16} {'ms':>8} {'TFLOP/s':>8} {'max diff':>9}")
    for name, Lq, Lk in shapes:
        qkv = torch.randn(n, max(Lq, Lk), 3, H, 80, generator=g, device=dev, dtype=dt)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = q[:, :, :Lq], k[:, :, :Lk], v[:, :, :Lk]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2)
        flops = 4 * n * H * Lq * Lk * 80
        ms = timed(lambda: F.scaled_dot_product_attention(q, k, v), args.runs)  # noqa: B023
        print(f"{name:16} {'sdpa':5} {'':5} {'':16} {ms:8.3f} {flops / ms / 1e9:8.1f}")
        for qk_wide in (False, True):
            for pv_wide in (False, True):
                for bm, bn, w, st in tiles:
                    label = f"{bm}x{bn} w{w} s{st}"
                    try:
                        out = variant(q, k, v, qk_wide, pv_wide, bm, bn, w, st)
                        ms = timed(lambda: variant(q, k, v, qk_wide, pv_wide, bm, bn, w, st),  # noqa: B023
                                   args.runs)
                    except Exception as e:  # noqa: BLE001 (resources: skip the shape)
                        print(f"{name:16} {'128' if qk_wide else '64+16':5} "
                              f"{'128' if pv_wide else '64+16':5} {label:16} n/a "
                              f"({str(e).splitlines()[0][:50]})")
                        continue
                    diff = (out.float() - ref).abs().max().item()
                    print(f"{name:16} {'128' if qk_wide else '64+16':5} "
                          f"{'128' if pv_wide else '64+16':5} {label:16} {ms:8.3f} "
                          f"{flops / ms / 1e9:8.1f} {diff:9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
