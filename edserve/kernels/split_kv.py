"""Split-KV (flash-decoding) for the Triton attention kernels: when to split, where the
partial results go, and how they are merged.

With ``num_splits = S > 1`` an attention kernel runs ``S`` programs per (request, kv head,
q block), each over one contiguous slice of the request's key blocks, and writes (through
``common._store_rows``) per query row ``t`` and query head ``h``:

- ``part_o[s, t, h, :]``: the slice's softmax-normalised partial output (fp32), and
- ``part_lse[s, t, h]``: its log2-sum-exp (fp32, log2 units like the kernels' running max);
  ``-inf`` for a slice in which the row sees no key.

:func:`combine_splits` then writes ``out[t, h] = sum_s w_s o_s / sum_s w_s`` with
``w_s = 2^(lse_s - max_s lse_s)``: the unsplit result up to rounding. A row with no key in any
slice gets zeros, as in the unsplit kernels.

:func:`choose_num_splits` decides ``S`` from shapes alone (never from device data), so the
choice is the same on every replay of a CUDA graph; it returns 1 on CPU, and at most
``MAX_SPLITS``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 64


@triton.jit(do_not_specialize=["num_tokens", "NUM_SPLITS"])
def _combine_splits_kernel(PartO, PartLse, Out, num_tokens, num_q_heads, stride_ot, stride_oh,
                           NUM_SPLITS, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Grid (T, Hq): out[t, h] = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    prow = (s * num_tokens + t) * num_q_heads + h  # [SPLITS_PAD]
    lse = tl.load(PartLse + prow, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)  # [SPLITS_PAD]; empty splits -> 0
    o = tl.load(PartO + prow[:, None] * HEAD_DIM + d[None, :],
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)  # [BLOCK_D]
    tl.store(Out + t * stride_ot + h * stride_oh + d, res.to(Out.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


LONG_KV = 4096  # key ranges this long (Mllama's 4 x 1601 image tokens) split even on a full grid
LONG_KV_SPLITS = 8


def choose_num_splits(n_programs: int, max_kv: int, block_n: int, device: torch.device,
                      causal: bool = False) -> int:
    """Split-KV factor from shapes only (graph-safe): split when the (request, kv head, q block)
    grid underfills the GPU and the key range is long; each split keeps >= 4 key blocks.
    ``max_kv`` bounds the keys a row can have (under CUDA graphs: the page table's width).

    A grid that fills the GPU is still split 8 ways when a non-causal key range is
    ``LONG_KV`` or more: cross-attention rows of very uneven lengths (1-4 image tiles,
    text-only rows) leave most SMs idle in the last wave. Measured on the H200 (Mllama 11B
    cross layer, 8 kv heads, 1601 tokens a tile): 18 rows 282 -> 104 us, 72 rows 361 -> 325 us
    (``benchmarks/mllama_kernels.py``). Not for ``causal`` (self-attention) ranges: in a
    graph their bound is the whole row's table, encoder pages included, while the decoder's
    keys are few (Mllama 11B at 72 rows: see that benchmark's self-attention section). The
    cost: a full grid of very uneven long histories (one long chat among short ones) loses
    the last-wave balance the split gave it; uniform 1024-2048-key rows measured the same
    either way."""
    if device.type != "cuda" or n_programs == 0:
        return 1
    sms = _sm_count(device)
    if n_programs >= sms:
        return max(1, min(LONG_KV_SPLITS, triton.cdiv(max_kv, block_n) // 4)) \
            if max_kv >= LONG_KV and not causal else 1
    by_fill = triton.cdiv(2 * sms, n_programs)
    by_len = triton.cdiv(max_kv, block_n) // 4
    return max(1, min(by_fill, by_len, MAX_SPLITS))


def split_workspaces(num_splits: int, T: int, Hq: int, D: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [S, T, Hq, D] and log2-sum-exps [S, T, Hq] for split-KV."""
    part_o = torch.empty((num_splits, T, Hq, D), dtype=torch.float32, device=device)
    part_lse = torch.empty((num_splits, T, Hq), dtype=torch.float32, device=device)
    return part_o, part_lse


def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split-KV partial results into ``out`` [T, Hq, D]."""
    S, T, Hq, D = part_o.shape
    _combine_splits_kernel[(T, Hq)](
        part_o, part_lse, out, T, Hq, out.stride(0), out.stride(1), S,
        SPLITS_PAD=triton.next_power_of_2(S), HEAD_DIM=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=1)
