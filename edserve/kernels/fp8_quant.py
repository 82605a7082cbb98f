"""Per-row fp8 quantization of activations in one pass (``--encoder-dtype fp8``), optionally
with the GELU that precedes it.

``quantize_rows_fp8(x, gelu)`` computes what :func:`edserve.models.fp8.quantize_rows` computes
for ``g(x)``, where ``g`` is the identity, the erf GELU or its tanh form, rounded to ``x``'s
dtype (as ``F.gelu`` rounds its output): per row ``scale = max(amax / 448, 1e-12)`` (fp32,
the same bits) and ``q = clamp(g(x) * (1 / scale), -448, 448)`` cast to ``float8_e4m3fn``
(round to nearest even); the product is within 2 fp32 ulps of torch's ``g(x) / scale``, so a
code differs from ``quantize_rows``'s only next to a rounding midpoint (the GPU test bounds
their share).

The torch ops it replaces make four memory passes with an fp32 intermediate (norm, divide,
clamp, cast), plus the GELU's own read and write of the ``[tokens, ffn]`` activations; on the
H200 that scaling took 70 ms of a 181 ms large-v3 prefill step of 32 clips, so the fp8
encoder was slower than bf16 (benchmarks/RESULTS.md, wave 3). Here one program reads a row
once (bf16) and writes it once (fp8) plus one fp32 scale.

No host syncs, no data-dependent shapes: safe under CUDA graph capture. Under
``TRITON_INTERPRET=1`` (CPU tests) the interpreter's fp8 cast does not round like the GPU's,
so tests ask for ``out_dtype=torch.float32`` there: the scaled, clamped values before the cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.norm_act import _rows

MAX_QUANT_DIM = 16384  # one program holds a row
GELU_MODES = {None: 0, "exact": 1, "tanh": 2}
# Launch shape, from benchmarks/fp8_quant_gpu.py on the H200 (24,000 tokens): a row per program,
# 2 warps for 1280 (28.9 us vs 42.0 with 8 warps; floor 22.2) and 4 for 5120 with the GELU
# (234 vs 241 us with 16); more rows per program did not help.
TILE_ELEMENTS = 1024  # rows narrower than this are packed into one program up to it
WARP_ELEMENTS = 1024  # elements per warp (32 per thread), 2 to 4 warps


@triton.jit
def _quant_rows_kernel(X, Q, S, stride_x, stride_q, n_rows, n_cols, GELU: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]  # [ROWS, BLOCK]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if GELU == 1:  # erf GELU, rounded to x's dtype like F.gelu's output
        x = (0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))).to(X.dtype.element_ty)
        x = x.to(tl.float32)
    if GELU == 2:  # tanh form: tanh(u) = 1 - 2 / (exp(2u) + 1); |u| > 15: tanh = +-1 in fp32
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        u = tl.minimum(tl.maximum(u, -15.0), 15.0)
        x = (0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))).to(X.dtype.element_ty)
        x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)  # [ROWS]
    scale = tl.maximum(amax / 448.0, 1e-12)  # 448: e4m3's largest finite (models.fp8.FP8_MAX)
    # x times the row's reciprocal: within 2 fp32 ulps of torch's x / scale (an IEEE division
    # per element, tl.math.div_rn, measured 2.2-2.4x slower on the H200: 28.9 -> 69.5 us at
    # 1280); the fp8 codes differ only where x / scale lies that close to a rounding midpoint
    inv = 1.0 / scale  # [ROWS]
    q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows, scale, mask=rmask)


def launch_shape(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, rows per program, warps) for rows of ``n_cols``: a program holds whole rows,
    packed up to :data:`TILE_ELEMENTS` elements."""
    block = triton.next_power_of_2(n_cols)
    rows = max(1, TILE_ELEMENTS // block)
    return block, rows, min(4, max(2, rows * block // WARP_ELEMENTS))


def quantize_rows_fp8(x: torch.Tensor, gelu: str | None = None,
                      out_dtype: torch.dtype = torch.float8_e4m3fn, *,
                      rows: int | None = None, num_warps: int | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (rows contiguous in K) -> (q ``[M, K]`` ``out_dtype``, scales ``[M, 1]``
    fp32), ``g(x) ~= q * scale`` with ``g`` chosen by ``gelu`` (None, ``"exact"``, ``"tanh"``);
    see the module doc. ``rows``/``num_warps`` override :func:`launch_shape` (benchmarks).
    ``ValueError`` for another shape or mode."""
    if gelu not in GELU_MODES:
        raise ValueError(f"gelu must be one of {list(GELU_MODES)}, got {gelu!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    if K > MAX_QUANT_DIM:
        raise ValueError(f"quantize_rows_fp8: row length {K} > {MAX_QUANT_DIM}")
    x2 = _rows(x, "x")
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and K:
        block, r, w = launch_shape(K)
        r, w = rows or r, num_warps or w
        _quant_rows_kernel[(triton.cdiv(M, r),)](x2, q, scale, x2.stride(0), q.stride(0), M, K,
                                                 GELU=GELU_MODES[gelu], ROWS=r, BLOCK=block,
                                                 num_warps=w)
    return q, scale
