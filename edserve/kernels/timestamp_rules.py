"""Whisper's timestamp grammar over a batch of logits rows, one Triton program a row.

The same rules as :class:`edserve.whisper.logits.ApplyTimestampRules` (its tensor ops are the
reference and the CPU path): each row's allowed tokens are ``[a, b) U [c, V)`` minus
``<|notimestamps|>``, with ``a, b, c`` from the row's sampled tokens (open / closed timestamp
pair, the last timestamp, the first position's latest initial timestamp); then, when the
timestamp tokens together are likelier than any single text token (``logsumexp(logits[tb:]) >
max(logits[:tb])``: the log-softmax terms share their normaliser), every text token is masked.

torch ran those rules as ~20 small kernels over ``[R, V]`` and ``[R, C]`` tensors (a bool mask
of the whole batch, a logsumexp, an amax, two fills). Here a program reads its row's history
once, then the logits row twice at most: a pass that masks and accumulates the text maximum and
the timestamps' logsumexp, and a pass that masks the text columns when the timestamps win. In
place; no host syncs (safe under CUDA graph capture). NaN logits are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edserve.kernels.common import check_logit_rows

BLOCK_V = 2048  # logits per block
NUM_WARPS = 4


@triton.jit
def _timestamp_rules_kernel(Logits, History, Lengths, stride_l, stride_h, n_cols, hist_cols,
                            eot, no_ts, tb, top, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(Lengths + r)
    # the row's history: its last two tokens and its last timestamp (position and token)
    pos = tl.arange(0, BLOCK_C)
    seen = pos < tl.minimum(n, hist_cols)
    h = tl.load(History + r * stride_h + pos, mask=seen, other=-1)  # [C]
    last_tok = tl.max(tl.where(pos == n - 1, h, -1), 0)
    penult_tok = tl.max(tl.where(pos == n - 2, h, -1), 0)
    where = tl.max(tl.where(seen & (h >= tb), pos, -1), 0)
    last_ts_tok = tl.max(tl.where(pos == where, h, -1), 0)
    last_ts = (n >= 1) & (last_tok >= tb)
    penult_ts = (n < 2) | (penult_tok >= tb)
    pair_open = last_ts & (penult_ts == 0)
    pair_closed = last_ts & penult_ts
    first = n == 0
    lowest = tl.where(where >= 0, tl.where(pair_open, last_ts_tok, last_ts_tok + 1), tb)
    a = tl.where(first, tb, tl.where(pair_open, eot, 0))
    b = tl.where(first, top, tb)
    c = tl.where(first | pair_closed, n_cols, lowest)
    # pass 1: mask, and the text maximum / the timestamps' logsumexp of what stays
    base = Logits + r * stride_l
    offs = tl.arange(0, BLOCK_V)
    best_text = tl.full([], float("-inf"), tl.float32)
    m_run = tl.full([], float("-inf"), tl.float32)
    s_run = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        col = start + offs
        inside = col < n_cols
        x = tl.load(base + col, mask=inside, other=float("-inf"))
        allowed = (((col >= a) & (col < b)) | (col >= c)) & (col != no_ts)
        x = tl.where(allowed, x, float("-inf"))
        tl.store(base + col, x, mask=inside)
        best_text = tl.maximum(best_text, tl.max(tl.where(col < tb, x, float("-inf")), 0))
        xs = tl.where(col >= tb, x, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(xs, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - ref) + tl.sum(tl.exp(xs - ref), 0)
        m_run = m_new
    ts_mass = tl.where(s_run > 0, m_run + tl.log(tl.where(s_run > 0, s_run, 1.0)),
                       float("-inf"))
    # pass 2: the timestamps together likelier than any text token: force one
    if ts_mass > best_text:
        for start in range(0, tb, BLOCK_V):
            col = start + offs
            tl.store(base + col, tl.full([BLOCK_V], float("-inf"), tl.float32),
                     mask=col < tb)


def apply_timestamp_rules(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor,
                          eot: int, no_timestamps: int, ts_begin: int,
                          max_initial_index: int | None) -> None:
    """In place on ``logits`` ``[R, V]`` float32 (contiguous rows); ``history`` ``[R, C]``
    int64, the sampled tokens (the first ``lengths[r]`` valid); ``lengths`` ``[R]`` int64.
    ``max_initial_index``: the latest first timestamp, in timestamp steps (None: any)."""
    R, V = check_logit_rows(logits)
    if history.dim() != 2 or history.shape[0] != R or history.dtype != torch.int64 \
            or history.stride(1) != 1 or lengths.shape != (R,) or lengths.dtype != torch.int64:
        raise ValueError(f"history must be [R={R}, C] int64 (contiguous rows) and lengths [R] "
                         f"int64; got {tuple(history.shape)} {history.dtype}, "
                         f"{tuple(lengths.shape)} {lengths.dtype}")
    if not 0 < ts_begin <= V:
        raise ValueError(f"ts_begin must be in 1..V={V}, got {ts_begin}")
    if R == 0:
        return
    C = history.shape[1]
    top = V if max_initial_index is None else min(V, ts_begin + max_initial_index + 1)
    _timestamp_rules_kernel[(R,)](
        logits, history, lengths, logits.stride(0), history.stride(0), V, C, eot,
        no_timestamps, ts_begin, top, BLOCK_V=BLOCK_V,
        BLOCK_C=max(16, triton.next_power_of_2(max(C, 1))), num_warps=NUM_WARPS)
