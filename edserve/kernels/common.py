"""Pieces shared by the paged and flat Triton attention kernels.

Both kernels map one program to (request, kv head, q block[, kv split]). The program's rows are
``(query, head-in-group)`` pairs: row ``r`` is query ``qblk * QPB + r // G`` of the request and
query head ``kv_head * G + r % G`` (``G = Hq // Hkv``), so every K/V tile is loaded once for all
``G`` query heads of its kv head. Scores, the running max and the running sum are fp32; the
running max is kept in log2 units (``qk_scale = scale * log2(e)``) so the loop uses ``exp2``.

A row that sees no key (empty key set, or a causal row before the first key) ends with
``l == 0`` and is written as zeros, like ``torch_ops`` (softmax NaN -> 0).

Split-KV (flash-decoding): with ``NUM_SPLITS > 1`` each program covers one contiguous slice of
the request's key blocks and :func:`_store_rows` writes a normalised partial output plus its
log2-sum-exp to fp32 workspaces; :mod:`edserve.kernels.split_kv` sizes, allocates and merges
them. Empty slices write ``lse = -inf``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _row_setup(CuQ, KvLens, KvRanges, stride_rg, b, qblk, G: tl.constexpr, QPB: tl.constexpr,
               BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_RANGES: tl.constexpr):
    """Rows of one program: token index, head-in-group, validity, and the visible keys of each
    row (``first <= j <= lim``); keys ``[kv_begin, kv_end)`` cover every valid row's keys."""
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    kv_len = tl.load(KvLens + b)
    r = tl.arange(0, BLOCK_M)
    qi = qblk * QPB + r // G  # [BLOCK_M] query position inside the request
    hg = r % G  # [BLOCK_M] head inside the kv head's group
    row_valid = (r < QPB * G) & (qi < q_len)
    tok = (q_start + qi).to(tl.int64)  # [BLOCK_M] row of q / out
    # Keys a program can need: up to the last visible key of its last valid query.
    q_last = tl.minimum(q_len - 1, qblk * QPB + QPB - 1)
    if CAUSAL:
        kv_end = tl.minimum(kv_len, kv_len - q_len + q_last + 1)
        lim = kv_len - q_len + qi  # key j is visible iff j <= lim (bottom-right aligned)
    else:
        kv_end = kv_len
        lim = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len - 1
    kv_end = tl.maximum(kv_end, 0)
    lim = tl.minimum(lim, kv_end - 1)
    first = tl.zeros([BLOCK_M], dtype=tl.int32)
    kv_begin = kv_len * 0  # scalar tensor either way
    if HAS_RANGES:  # per-token key window [start, end) (Mllama cross-attention masks)
        first = tl.load(KvRanges + tok * stride_rg, mask=row_valid, other=0).to(tl.int32)
        stop = tl.load(KvRanges + tok * stride_rg + 1, mask=row_valid, other=0).to(tl.int32)
        lim = tl.minimum(lim, stop - 1)
        kv_begin = tl.maximum(tl.min(tl.where(row_valid, first, 2147483647), 0), 0)
    return tok, hg, row_valid, first, lim, kv_begin, kv_end, q_len


@triton.jit
def _attend_block(q, k_base, v_base, slot, kmask, d, dmask, stride_kt, stride_vt, j, first, lim,
                  m, lsum, acc, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Load the keys and values of one block of pool slots (``slot`` [N], masked by ``kmask``
    [N] and ``dmask`` [D]) and fold them into the online softmax: the loop body every paged /
    flat / grouped attention kernel shares; they differ only in how they find ``slot``."""
    kT = tl.load(k_base + slot[None, :] * stride_kt + d[:, None],
                 mask=kmask[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :],
                mask=kmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    return _softmax_step(q, kT, v, j, first, lim, m, lsum, acc, qk_scale, PRECISION, UPCAST)


@triton.jit
def _softmax_step(q, kT, v, j, first, lim, m, lsum, acc, qk_scale, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    """One online-softmax update. q [M, D]; kT [D, N]; v [N, D]; j [N] key positions; row r
    sees keys ``first[r] <= j <= lim[r]``. UPCAST: fp32 dots (the CPU interpreter's bf16 dot is
    wrong)."""
    if UPCAST:
        q = q.to(tl.float32)
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    else:  # an fp8 KV cache is dequantized here (scale 1); a no-op for q's own dtype
        kT = kT.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # [M, N] fp32, log2 units
    s = tl.where((j[None, :] >= first[:, None]) & (j[None, :] <= lim[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked rows: keep p == 0
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, lsum, acc


@triton.jit
def _store_rows(Out, PartO, PartLse, acc, m, lsum, tok, hq, row_valid, d, split, num_tokens,
                num_q_heads, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Final rows to ``Out`` (q dtype), or partial rows + lse to the split workspaces."""
    safe_l = tl.where(lsum == 0.0, 1.0, lsum)
    o = acc / safe_l[:, None]  # rows with no key: acc == 0 -> 0
    mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
    if IS_SPLIT:
        prow = (split * num_tokens + tok) * num_q_heads + hq  # [M] row of [S, T, Hq]
        tl.store(PartO + prow[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(lsum == 0.0, float("-inf"), m + tl.log2(safe_l))
        tl.store(PartLse + prow, lse, mask=row_valid)
    else:
        ptr = Out + tok[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :]
        tl.store(ptr, o.to(Out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host helpers


def check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int,
                 kv_ranges: torch.Tensor | None,
                 out: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Validate the arguments both kernels share (shapes, dtypes, devices; no device syncs).

    Returns ``(T, Hq, Hkv, D, B)``. Raises ``ValueError`` with a readable message.
    """
    T, Hq, Hkv, D = check_qkv(q, k_cache, v_cache, out)
    if kv_lens.dim() != 1 or cu_q.dim() != 1 or cu_q.shape[0] != kv_lens.shape[0] + 1:
        raise ValueError(f"need kv_lens [B] and cu_q [B+1]; got {tuple(kv_lens.shape)}, "
                         f"{tuple(cu_q.shape)}")
    check_index("kv_lens", kv_lens)
    check_index("cu_q", cu_q)
    if not isinstance(max_q, int) or max_q < 0:
        raise ValueError(f"max_q must be a non-negative Python int, got {max_q!r}")
    devs = {t.device for t in (q, kv_lens, cu_q)}
    if kv_ranges is not None:
        if kv_ranges.shape != (T, 2) or kv_ranges.stride(1) != 1:
            raise ValueError(f"kv_ranges must be [T, 2] = [{T}, 2] with unit column stride, got "
                             f"{tuple(kv_ranges.shape)}")
        check_index("kv_ranges", kv_ranges)
        devs.add(kv_ranges.device)
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    return T, Hq, Hkv, D, kv_lens.shape[0]


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              out: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validate queries, caches and the optional output buffer (shapes, dtypes, one device,
    a device the kernels run on). Returns ``(T, Hq, Hkv, D)``."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q [T, Hq, D] and caches [num_slots, Hkv, D] must be 3-D; got "
                         f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.shape[2] != D:
        raise ValueError(f"head_dim mismatch: q has {D}, caches have {k_cache.shape[2]}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} unsupported (1..{MAX_HEAD_DIM})")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    kv_ok = k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    if not kv_ok:  # an fp8 cache (scale 1) is cast to q's dtype as it is read
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} unsupported (float16, bfloat16, float32)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must match q: {tuple(out.shape)} {out.dtype} {out.device}")
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    devs = {t.device for t in (q, k_cache, v_cache)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
                         "use edserve.layers.attention.torch_ops on CPU")
    return T, Hq, Hkv, D


def check_logit_rows(logits: torch.Tensor) -> tuple[int, int]:
    """``(rows, V)`` of a ``[rows, V]`` float32 logits tensor with contiguous rows on a device
    the Triton logits kernels run on (CUDA, or the interpreter); else ``ValueError``."""
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] float32, contiguous rows; got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    return logits.shape[0], logits.shape[1]


def check_index(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (the kernels index it as a flat array)")


def block_m_for(max_q: int, group: int) -> tuple[int, int]:
    """Rows per program (power of two >= 16) and queries per program for a q block."""
    cap = max(64, triton.next_power_of_2(group))
    block_m = min(cap, max(16, triton.next_power_of_2(max_q * group)))
    return block_m, block_m // group


def tile_config(block_m: int, block_d: int, dtype: torch.dtype, want_n: int) -> tuple[int, dict]:
    """Key block size (<= ``want_n``, a power of two >= 16) and launch options.

    Sized with ptxas for sm_90 (Triton 3.6) to stay within 255 registers without spills: fp32
    runs IEEE dots on CUDA cores, which hold whole tiles in registers, so its tiles are smaller.
    """
    if dtype == torch.float32:
        block_n = min(want_n, 64 if block_m <= 16 and block_d <= 64 else 16)
        num_warps = 8 if block_m >= 32 else 4
    else:
        block_n = min(want_n, 128 if block_d <= 128 else 64)
        num_warps = 8 if block_m >= 64 else 4
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return block_n, {"num_warps": num_warps, "num_stages": 2,
                     "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
                     "UPCAST": interpret and dtype == torch.bfloat16}
