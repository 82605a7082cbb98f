"""Page layout of new tokens: argument checks and the vectorised slot computation.

The invariant every allocator keeps: a request's token at row position ``t`` sits at page
offset ``t % page_size``, and the tokens of one page are consecutive positions. So the slot of
``t`` is ``page_table[t // ps] * ps + t % ps``, with ``page_table = req_to_token[:, ::ps] // ps``.

Extend (positions ``prefix .. seq-1`` of each request), three phases::

    prefix's last page        whole new pages           tail page
    [last_loc+1 .. page end]  [p*ps .. p*ps+ps-1] ...   [q*ps .. q*ps + seq%ps - 1]

Decode (position ``seq-1``): a new page iff ``(seq - 1) % ps == 0``, else ``last_loc + 1``.
All functions here are batched torch ops; the checks cost one device->host sync.
"""

from __future__ import annotations

import torch

from edserve.mem_cache.errors import AlignmentError, KVCacheError
from edserve.mem_cache.page_book import PageBook


def _index(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def as_index(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 on ``device``, unchecked (the sync-free path: callers pass 1-D integer tensors)."""
    return torch.as_tensor(t).to(device=device, dtype=torch.int64)


def _owned_page_bad(book: PageBook, loc: torch.Tensor) -> torch.Tensor:
    """[B] bool: ``loc`` is not a slot of a handed-out page."""
    ps = book.page_size
    page = torch.div(loc, ps, rounding_mode="floor").clamp(0, book.num_pages)
    return (loc < ps) | (loc >= (book.num_pages + 1) * ps) | (book.refcount[page] == 0)


def check_extend_args(
    book: PageBook,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    extend_num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate extend arguments; return int64 (prefix, seq, last_loc) [B] and #new pages."""
    dev, ps = book.device, book.page_size
    prefix = _index(prefix_lens, "prefix_lens", dev)
    seq = _index(seq_lens, "seq_lens", dev)
    last = _index(last_loc, "last_loc", dev)
    if not prefix.shape == seq.shape == last.shape:
        raise ValueError(
            f"alloc_extend: prefix_lens {tuple(prefix.shape)}, seq_lens {tuple(seq.shape)} and "
            f"last_loc {tuple(last.shape)} must have the same length"
        )
    bad_len = (prefix < 0) | (seq < prefix)
    misaligned = (torch.remainder(last + 1, ps) != torch.remainder(prefix, ps)) | (
        (prefix == 0) & (last != -1)
    )
    partial = torch.remainder(prefix, ps) != 0  # new tokens start inside the prefix's page
    bad_page = partial & _owned_page_bad(book, last)
    new_pages = _cdiv(seq, ps) - _cdiv(prefix, ps)  # [B]
    n_bad_len, total, n_mis, n_bad_page, n_pages = torch.stack(
        [
            bad_len.sum(),
            (seq - prefix).sum(),
            misaligned.sum(),
            bad_page.sum(),
            new_pages.sum(),
        ]
    ).tolist()  # the one sync
    if n_bad_len:
        i = int(torch.nonzero(bad_len)[0])
        raise ValueError(
            f"alloc_extend: request {i} has prefix_len {int(prefix[i])} > seq_len {int(seq[i])} "
            f"(or a negative length)"
        )
    if total != extend_num_tokens:
        raise ValueError(
            f"alloc_extend: extend_num_tokens={extend_num_tokens} but sum(seq_lens - "
            f"prefix_lens) = {total}"
        )
    if n_mis:
        i = int(torch.nonzero(misaligned)[0])
        raise AlignmentError(
            f"alloc_extend: request {i}: last_loc {int(last[i])} cannot hold position "
            f"{int(prefix[i]) - 1} at page size {ps} (need (last_loc + 1) % ps == prefix_len % ps,"
            f" and last_loc == -1 for an empty prefix)"
        )
    if n_bad_page:
        i = int(torch.nonzero(bad_page)[0])
        raise KVCacheError(
            f"alloc_extend: request {i}: last_loc {int(last[i])} is not on a handed-out page, "
            f"so its partial page cannot be filled"
        )
    return prefix, seq, last, int(n_pages)


def check_decode_args(
    book: PageBook, seq_lens: torch.Tensor, last_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate decode arguments; return int64 (seq, last_loc) [B], the [B] bool "needs a new
    page" mask and the number of new pages."""
    dev, ps = book.device, book.page_size
    seq = _index(seq_lens, "seq_lens", dev)
    last = _index(last_loc, "last_loc", dev)
    if seq.shape != last.shape:
        raise ValueError(
            f"alloc_decode: seq_lens {tuple(seq.shape)} and last_loc {tuple(last.shape)} differ"
        )
    new_page = torch.remainder(seq - 1, ps) == 0  # [B]
    misaligned = (torch.remainder(last + 2, ps) != torch.remainder(seq, ps)) | (
        (seq == 1) & (last != -1)
    )
    bad_page = ~new_page & _owned_page_bad(book, last)
    n_bad_len, n_mis, n_bad_page, n_new = torch.stack(
        [(seq < 1).sum(), misaligned.sum(), bad_page.sum(), new_page.sum()]
    ).tolist()  # the one sync
    if n_bad_len:
        raise ValueError("alloc_decode: seq_lens (lengths after the new token) must be >= 1")
    if n_mis:
        i = int(torch.nonzero(misaligned)[0])
        raise AlignmentError(
            f"alloc_decode: request {i}: last_loc {int(last[i])} cannot hold position "
            f"{int(seq[i]) - 2} at page size {ps} (need (last_loc + 2) % ps == seq_len % ps)"
        )
    if n_bad_page:
        i = int(torch.nonzero(bad_page)[0])
        raise KVCacheError(
            f"alloc_decode: request {i}: last_loc {int(last[i])} is not on a handed-out page"
        )
    return seq, last, new_page, int(n_new)


def segment_ids(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: for each element of the concatenated segments, its segment index.

    ``lengths``: [B] non-negative, summing to ``total``. Same as ``repeat_interleave(arange(B),
    lengths)`` but sync-free and cheap on CPU.
    """
    ends = torch.cumsum(lengths, 0)  # [B]
    return torch.searchsorted(ends, torch.arange(total, device=lengths.device), right=True)


def _cdiv(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x + d - 1, d, rounding_mode="floor")


def extend_slots(
    prefix: torch.Tensor,
    seq: torch.Tensor,
    last: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Slots of the new tokens, concatenated in request order (int64 [extend_num_tokens]).

    prefix, seq, last: [B] int64; pages: [sum of new pages] int64, handed to the requests in
    order (request i's new pages are consecutive in ``pages``).
    """
    ps, dev = page_size, prefix.device
    ext = seq - prefix  # [B] new tokens
    tok_start = torch.cumsum(ext, 0) - ext  # [B] first token of request i in the output
    aligned = _cdiv(prefix, ps) * ps  # [B] first position on a fresh page
    new_pages = _cdiv(seq, ps) - _cdiv(prefix, ps)
    page_start = torch.cumsum(new_pages, 0) - new_pages  # [B] first page of request i in pages
    req = segment_ids(ext, extend_num_tokens)  # [T] request of each new token
    pos = prefix[req] + torch.arange(extend_num_tokens, device=dev) - tok_start[req]  # [T]
    # phase 1: the prefix's partial last page continues right after last_loc
    partial_slot = last[req] + 1 + (pos - prefix[req])
    if pages.numel() == 0:
        return partial_slot
    # phases 2 + 3: the k-th fresh page of the request holds positions aligned + k*ps ...
    k = torch.div(pos - aligned[req], ps, rounding_mode="floor").clamp(min=0)
    page = pages[(page_start[req] + k).clamp(max=pages.numel() - 1)]
    fresh_slot = page * ps + torch.remainder(pos, ps)
    return torch.where(pos < aligned[req], partial_slot, fresh_slot)


def decode_slots(
    last: torch.Tensor, new_page: torch.Tensor, pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Slot of each request's new token (int64 [B]): first slot of a fresh page where
    ``new_page``, else ``last + 1``. pages: [new_page.sum()] in request order."""
    if pages.numel() == 0:
        return last + 1
    which = (torch.cumsum(new_page.to(torch.int64), 0) - 1).clamp(min=0)  # [B]
    return torch.where(new_page, pages[which] * page_size, last + 1)
