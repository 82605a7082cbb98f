"""Page tables derived from ``req_to_token``.

Allocators keep a request's token ``t`` at page offset ``t % page_size`` with the tokens of a
page consecutive, so the page of token ``t`` is ``req_to_token[row, t - t % ps] // ps`` and the
page table is every ``ps``-th column divided by ``ps``::

    page_table[i, j] = req_to_token[rows[i], j * ps] // ps        int32 [B, ceil(cols / ps)]
    slot of token t  = page_table[i, t // ps] * ps + t % ps
"""

from __future__ import annotations

import torch


def page_table_from_req_to_token(
    req_to_token: torch.Tensor,
    page_size: int,
    rows: torch.Tensor | None = None,
    num_pages: int | None = None,
) -> torch.Tensor:
    """``req_to_token[rows][:, ::page_size] // page_size`` as int32 ``[B, num_pages]``.

    rows: [B] row indices (all rows when None). num_pages: keep the first ``num_pages`` pages
    (zero-padded, i.e. pointing at the padding page, if the table has fewer columns).
    Entries past a request's length are stale and must be masked by its length.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table = req_to_token if rows is None else req_to_token[rows.to(req_to_token.device)]
    pt = torch.div(table[:, ::page_size], page_size, rounding_mode="floor").to(torch.int32)
    if num_pages is not None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages <= pt.shape[1]:
            pt = pt[:, :num_pages]
        else:
            pt = torch.nn.functional.pad(pt, (0, num_pages - pt.shape[1]))
    return pt.contiguous()
