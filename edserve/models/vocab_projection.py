"""The tied output projection ``hidden [N, d] -> logits [N, V]`` (Whisper's token embedding
read as the vocabulary matrix), by the fastest kernel for the device and shape.

* One bf16 row on the CPU: a matrix-vector product (``opaque_linear.mv``) reads tiny.en's 40 MB
  vocabulary faster than ``F.linear``'s GEMM (1.03 vs 1.45 ms on an AMX Xeon, the same values;
  benchmarks/RESULTS.md, wave 22), also inside a compiled step.
* CUDA, a vocabulary whose rows of logits are not a multiple of 16 bytes (the multilingual
  models: 51,865 / 51,866 tokens in bf16): cuBLAS then runs an unvectorised ``align2`` kernel
  (and still does when ``mm`` writes into a row-padded ``out=`` view: measured, no gain). The
  model keeps its token embedding as the first ``V`` rows of a zero-padded ``[P, d]`` buffer
  (:func:`pad_rows`, the same memory); multiplying by the whole buffer gives an aligned
  ``[N, P]`` output whose ``[N, V]`` view is returned (row stride ``P``; consumers read rows by
  stride). On the H200 (``benchmarks/logits_gemm_gpu.py``, wave 25, this function): 78.8 ->
  36.5 us at 64 rows, 206.0 -> 72.4 us at 320 (a beam step), 46.6 -> 36.8 us at one row.
* Otherwise ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edserve.models.opaque_linear import mv

ROW_ALIGN_BYTES = 16


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor,
                 padded: torch.Tensor | None = None) -> torch.Tensor:
    """hidden ``[N, d]``, weight ``[V, d]`` -> logits ``[N, V]`` in hidden's dtype. ``padded``:
    the buffer ``weight`` is the first rows of (:func:`pad_rows`); ignored unless it still is
    (same memory, same width), so a weight replaced since cannot be read stale."""
    if hidden.shape[0] == 1 and hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu":
        return mv(weight, hidden[0])[None]
    if padded is not None and padded.data_ptr() == weight.data_ptr() \
            and padded.shape[1] == weight.shape[1] and padded.dtype == weight.dtype:
        return F.linear(hidden, padded)[:, :weight.shape[0]]
    return F.linear(hidden, weight)


def pad_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """A zero-padded ``[P, d]`` copy of ``weight`` ``[V, d]`` (``P``: :func:`padded_width`)
    when a row of logits would be unaligned, else None. The caller makes ``weight`` the
    buffer's first ``V`` rows (so the model holds one copy)."""
    width = padded_width(weight.shape[0], weight.element_size())
    if width is None:
        return None
    buf = torch.zeros(width, weight.shape[1], dtype=weight.dtype, device=weight.device)
    buf[:weight.shape[0]] = weight
    return buf


def padded_width(vocab: int, element_size: int) -> int | None:
    """The row width (elements) that puts each row of logits on ``ROW_ALIGN_BYTES``, or None
    when ``vocab`` elements already are."""
    per = ROW_ALIGN_BYTES // element_size
    return None if vocab % per == 0 else -(-vocab // per) * per
