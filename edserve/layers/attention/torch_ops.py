"""Torch reference attention ops: any device, any dtype (float64 makes them the test oracle).

Three ways to read a batch's keys/values, one per encoder-KV strategy. They share the
variable-length attention core and differ only in how key indices are found:

* :func:`varlen_attention` - keys already contiguous per request (``cu_k`` offsets).
* :func:`paged_attention` - keys read through a page table (one page id per ``page_size`` tokens).
* :func:`flat_attention` - keys read through token slots (``req_to_token`` rows directly).

Shared conventions (the Triton kernels in ``edserve.kernels`` implement the same signatures):
  q ``[T, Hq, D]``; caches ``[num_slots, Hkv, D]``; ``Hq % Hkv == 0`` (grouped-query attention);
  ``cu_q`` ``[B+1]`` offsets of each request's queries; ``causal`` is bottom-right aligned: query
  ``i`` of a request with ``L`` queries and ``S`` keys sees keys ``j <= S - L + i``. A request with
  zero keys gets a zero output. Returns ``[T, Hq, D]`` in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype attention is computed in: float64 when either side is (the oracle); the
    cache's own dtype when the queries have it too (SDPA's kernels accumulate bf16 / fp16 in
    float32 themselves: upcasting first copied the keys: eager tiny.en bf16 decode
    steps on CPU took 19-26 % less time without it, benchmarks/RESULTS.md wave 22); else float32
    (mixed dtypes)."""
    if torch.float64 in (q.dtype, k_cache.dtype):
        return torch.float64
    return q.dtype if q.dtype == k_cache.dtype else torch.float32


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            key_index: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int,
            causal: bool, scale: float, kv_ranges: torch.Tensor | None = None,
            memo: dict | None = None) -> torch.Tensor:
    """Attention over keys gathered by ``key_index`` ``[B, max_k]`` (entries past kv_lens ignored).

    ``kv_ranges`` ``[T, 2]`` optionally restricts query t to keys ``start <= j < end``.
    ``memo``: see :func:`flat_attention`.
    """
    T, Hq, D = q.shape
    B = kv_lens.shape[0]
    Hkv = k_cache.shape[1]
    if T == 0 or B == 0:
        return torch.zeros_like(q)
    memo = {} if memo is None else memo
    max_k = key_index.shape[1]
    if B == 1 and kv_ranges is None and q.device.type == "cpu" and (not causal or T == 1):
        if "one_range" not in memo:
            memo["one_range"] = one_range(key_index[0, :int(kv_lens[0])])
        if memo["one_range"] is not None:
            return _attend_range(q, k_cache, v_cache, *memo["one_range"], scale)
    if max_q == 1 and T == B and kv_ranges is None:  # decode: one query per request
        if "decode" not in memo:
            memo["decode"] = _decode_keys(key_index, kv_lens)
        return _attend_decode(q, k_cache, v_cache, *memo["decode"], scale)
    out = torch.zeros_like(q)
    q_lens = (cu_q[1:] - cu_q[:-1]).long()  # [B]
    # Pad queries to [B, max_q, Hq, D].
    qi = torch.arange(max_q, device=q.device)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, max_q]
    q_tok = (cu_q[:-1].long()[:, None] + qi[None, :]).clamp(max=max(T - 1, 0))
    qp = q[q_tok]  # [B, max_q, Hq, D]
    kj = torch.arange(max_k, device=q.device)
    k_valid = kj[None, :] < kv_lens.long()[:, None]  # [B, max_k]
    safe_idx = torch.where(k_valid, key_index.long(), torch.zeros_like(key_index.long()))
    flat_idx = safe_idx.reshape(-1)  # index_select: ~3.5x faster than k_cache[idx] on CPU
    kp = k_cache.index_select(0, flat_idx).view(B, max_k, Hkv, D)  # [B, max_k, Hkv, D]
    vp = v_cache.index_select(0, flat_idx).view(B, max_k, Hkv, D)
    mask = k_valid[:, None, :].expand(B, max_q, max_k)
    if causal:
        limit = kv_lens.long()[:, None] - q_lens[:, None] + qi[None, :]  # [B, max_q]
        mask = mask & (kj[None, None, :] <= limit[:, :, None])
    if kv_ranges is not None:
        rng = kv_ranges.long()[q_tok]  # [B, max_q, 2]
        mask = mask & (kj[None, None, :] >= rng[..., :1]) & (kj[None, None, :] < rng[..., 1:])
    acc = _acc_dtype(q, k_cache)
    qh = qp.permute(0, 2, 1, 3).to(acc)  # [B, Hq, max_q, D]
    kh = kp.permute(0, 2, 1, 3).to(acc)  # [B, Hkv, max_k, D]
    vh = vp.permute(0, 2, 1, 3).to(acc)
    ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=Hq != Hkv)  # [B, Hq, max_q, D]
    no_key = ~mask.any(-1)  # [B, max_q]: rows with no visible key -> zero output
    ctx = ctx.masked_fill(no_key[:, None, :, None], 0.0).permute(0, 2, 1, 3)  # [B, max_q, Hq, D]
    out[q_tok[q_valid]] = ctx[q_valid].to(q.dtype)
    return out


def _decode_keys(key_index: torch.Tensor, kv_lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layer's decode attention of one batch shares: the gather index ``[B *
    max_k]`` (slot 0 past a request's keys), the key mask ``[B, max_k]`` and which requests
    have a key ``[B]``."""
    B, max_k = key_index.shape
    k_valid = torch.arange(max_k, device=key_index.device)[None, :] < kv_lens[:, None]
    idx = torch.where(k_valid, key_index, 0).reshape(-1).long()
    return idx, k_valid, kv_lens > 0


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   idx: torch.Tensor, k_valid: torch.Tensor, has_keys: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`_attend` when request b has exactly one query (row b of q), which sees all of
    its keys (a decode step: causal or not, the last query sees every key); the keys as
    :func:`_decode_keys` gives them. The same SDPA call as the general path on
    ``[B, Hq, 1, D]``, with a third of its ops (on the 2-core CPU a beam-5 self-attention call
    went from ~0.67 to ~0.44 ms)."""
    B, max_k = k_valid.shape
    Hkv, D = k_cache.shape[1:]
    acc = _acc_dtype(q, k_cache)
    kp = k_cache.index_select(0, idx).view(B, max_k, Hkv, D).transpose(1, 2).to(acc)
    vp = v_cache.index_select(0, idx).view(B, max_k, Hkv, D).transpose(1, 2).to(acc)
    ctx = F.scaled_dot_product_attention(q[:, :, None].to(acc), kp, vp,
                                         attn_mask=k_valid[:, None, None, :], scale=scale,
                                         enable_gqa=q.shape[1] != Hkv)  # [B, Hq, 1, D]
    ctx = torch.where(has_keys[:, None, None], ctx[:, :, 0], 0.0)  # no key: zero
    return ctx.to(q.dtype)  # [B, Hq, D]


def one_range(slots: torch.Tensor) -> tuple[int, int] | None:
    """``(first slot, count)`` when the key slots ``[S]`` are one contiguous range, else None
    (host reads: asked once per batch through the memo)."""
    S = slots.shape[0]
    if S == 0:
        return 0, 0
    first = int(slots[0])
    if int(slots[-1]) - first != S - 1 or (S > 1 and not bool((slots.diff() == 1).all())):
        return None
    return first, S


def _attend_range(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, first: int,
                  S: int, scale: float) -> torch.Tensor:
    """CPU fast path of one request whose queries all see all its keys, slots ``first ..
    first + S - 1`` (:func:`one_range`): attend over a view of the caches (no gather, no
    mask). A one-clip CLI job hits it every decode step (a 1500-key encoder region is 2 x 2.3
    MB of tiny.en K/V per layer that the gather copied)."""
    if S == 0:
        return torch.zeros_like(q)
    acc = _acc_dtype(q, k_cache)
    k = k_cache[first:first + S].transpose(0, 1).to(acc)  # [Hkv, S, D] (a view in acc dtype)
    v = v_cache[first:first + S].transpose(0, 1).to(acc)
    qh = q.transpose(0, 1).to(acc)  # [Hq, T, D]
    ctx = F.scaled_dot_product_attention(qh[None], k[None], v[None], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[0])  # [1, Hq, T, D]
    return ctx[0].transpose(0, 1).to(q.dtype)  # [T, Hq, D]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                     scale: float, kv_ranges: torch.Tensor | None = None) -> torch.Tensor:
    """k, v ``[S, Hkv, D]`` contiguous per request at offsets ``cu_k`` ``[B+1]``."""
    kv_lens = cu_k[1:] - cu_k[:-1]
    key_index = cu_k[:-1].long()[:, None] + torch.arange(max_k, device=q.device)[None, :]
    return _attend(q, k, v, key_index, kv_lens, cu_q, max_q, causal, scale, kv_ranges)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, kv_start_page: torch.Tensor,
                    kv_lens: torch.Tensor, cu_q: torch.Tensor, max_q: int, causal: bool,
                    scale: float, page_size: int,
                    kv_ranges: torch.Tensor | None = None) -> torch.Tensor:
    """Keys of request b: token j lives at slot ``page_table[b, kv_start_page[b] + j // ps] * ps
    + j % ps``. page_table ``[B, max_pages]`` int32; kv_start_page, kv_lens ``[B]``."""
    max_k = int(kv_lens.max().item()) if kv_lens.numel() else 0
    j = torch.arange(max_k, device=q.device)
    col = (kv_start_page.long()[:, None] + j[None, :] // page_size).clamp(
        max=page_table.shape[1] - 1)
    key_index = page_table.long().gather(1, col) * page_size + j[None, :] % page_size
    return _attend(q, k_cache, v_cache, key_index, kv_lens, cu_q, max_q, causal, scale,
                   kv_ranges)


def flat_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   kv_start: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor,
                   max_q: int, causal: bool, scale: float,
                   kv_ranges: torch.Tensor | None = None, *,
                   memo: dict | None = None) -> torch.Tensor:
    """Keys of request b: token j lives at slot ``req_to_token[req_pool_indices[b],
    kv_start[b] + j]`` (page size irrelevant: the pool is viewed as page size 1).

    ``memo``: a dict owned by one batch's plan (every layer of one step passes the same one,
    with the same key tables): the key indices, the decode mask and the contiguity check are
    computed by the first layer and read by the others (on the 2-core CPU ~0.25 ms of index
    work per call, 8 calls per tiny.en decode step)."""
    memo = {} if memo is None else memo
    if "key_index" not in memo:
        max_k = int(kv_lens.max().item()) if kv_lens.numel() else 0
        j = torch.arange(max_k, device=q.device)
        col = (kv_start.long()[:, None] + j[None, :]).clamp(max=req_to_token.shape[1] - 1)
        memo["key_index"] = req_to_token[req_pool_indices.long()].long().gather(1, col)
    return _attend(q, k_cache, v_cache, memo["key_index"], kv_lens, cu_q, max_q, causal, scale,
                   kv_ranges, memo)
