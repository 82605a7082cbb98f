"""ReqToTokenPool: the request-to-token table, one row per running request.

``req_to_token[row, pos]`` is the KV slot holding token ``pos`` of the request that owns
``row``. Row 0 is padding (graph-padded batches point at it) and is never handed out::

    req_to_token  int32 [size + 1, max_context_len]
        row 0      : padding, stays zero
        rows 1..size: one per request holding a row; columns >= its length are stale

Free rows form a LIFO stack (the row freed last is handed out first). Requests are duck-typed:
any object with an attribute ``req_pool_idx: int | None`` (``None`` = holds no row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edserve.mem_cache.errors import (
    ContextOverflowError,
    DoubleFreeError,
    IndexOutOfRangeError,
    IntegrityError,
    KVCacheError,
    ReservedSlotError,
)


class ReqToTokenPool:
    """Rows of the request-to-token table and their free stack.

    Invariant: every row in ``1..size`` is either on the free stack or held by exactly one
    request; row 0 is never on the stack. ``alloc`` never mutates on shortage; every misuse
    raises before mutating.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1:
            raise ValueError(f"ReqToTokenPool needs at least 1 row, got size={size}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        # [size + 1, max_context_len] int32; row 0 is padding.
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.device = self.req_to_token.device
        # LIFO stack: pop() from the end hands out 1, 2, 3, ... on a fresh pool.
        self._free_rows: list[int] = list(range(size, 0, -1))
        self._is_free = [False] + [True] * size  # indexed by row; row 0 is never free
        # per row, how many times alloc has handed it out: (row, generation) names one
        # request's hold of a row (host caches of what a row's columns held key on it)
        self.generation = [0] * (size + 1)

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def num_held(self) -> int:
        """Number of rows currently held by requests."""
        return self.size - len(self._free_rows)

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """Give every request in ``reqs`` a row; return the rows in request order.

        Requests that already hold a row (chunked prefill) keep it and use no free row.
        Returns ``None``, changing nothing, when there are fewer free rows than new requests.
        """
        need = 0
        seen: set[int] = set()
        for req in reqs:
            if id(req) in seen:
                raise ValueError("the same request object appears twice in one alloc")
            seen.add(id(req))
            row = req.req_pool_idx
            if row is None:
                need += 1
            else:
                self._check_row(row, "alloc")
                if self._is_free[row]:
                    raise IntegrityError(f"a request claims row {row}, but that row is free")
        if need > len(self._free_rows):
            return None
        rows: list[int] = []
        for req in reqs:
            if req.req_pool_idx is None:
                row = self._free_rows.pop()
                self._is_free[row] = False
                self.generation[row] += 1
                req.req_pool_idx = row
            rows.append(req.req_pool_idx)
        return rows

    def free(self, req: Any) -> None:
        """Return ``req``'s row to the free stack and set ``req.req_pool_idx = None``."""
        row = req.req_pool_idx
        if row is None:
            raise DoubleFreeError("request holds no row (already freed or never allocated)")
        self._check_row(row, "free")
        if self._is_free[row]:
            raise DoubleFreeError(f"row {row} is already free")
        self._free_rows.append(row)
        self._is_free[row] = True
        req.req_pool_idx = None

    def check_held(self, row: int, action: str) -> None:
        """Raise unless ``row`` is a valid row currently held by a request."""
        self._check_row(row, action)
        if self._is_free[row]:
            raise KVCacheError(f"cannot {action} row {row}: it is not held by any request")

    # ------------------------------------------------------------------ writes
    def write(self, row: int, start: int, values: torch.Tensor) -> None:
        """``req_to_token[row, start:start + len(values)] = values`` (cast to int32).

        ``row`` must be held; raises ``ContextOverflowError`` if the write ends past
        ``max_context_len``.
        """
        self._check_row(row, "write to")
        if self._is_free[row]:
            raise KVCacheError(f"write to row {row}, which is not held by any request")
        if values.dim() != 1:
            raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"values must be integer slots, got dtype {values.dtype}")
        end = start + values.numel()
        if start < 0:
            raise IndexOutOfRangeError(f"write start {start} is negative")
        if end > self.max_context_len:
            raise ContextOverflowError(
                f"write of {values.numel()} tokens at column {start} ends at {end}, past "
                f"max_context_len={self.max_context_len} (row {row})"
            )
        self.req_to_token[row, start:end] = values.to(device=self.device, dtype=torch.int32)

    # ------------------------------------------------------------------ checks
    def check_integrity(self, num_held: int) -> None:
        """Raise ``IntegrityError`` unless free rows + ``num_held`` == size with a clean stack.

        ``num_held`` is the caller's count of requests holding a row (0 when idle).
        """
        free = self._free_rows
        if any(r == 0 for r in free):
            raise IntegrityError("row 0 (padding) is on the free stack")
        bad = [r for r in free if not 1 <= r <= self.size]
        if bad:
            raise IntegrityError(f"rows out of range 1..{self.size} on the free stack: {bad}")
        if len(set(free)) != len(free):
            dups = sorted({r for r in free if free.count(r) > 1})
            raise IntegrityError(f"rows on the free stack twice: {dups}")
        if sorted(free) != [r for r in range(1, self.size + 1) if self._is_free[r]]:
            raise IntegrityError("free stack and free-row flags disagree")
        if len(free) + num_held != self.size:
            diff = self.size - len(free) - num_held
            what = f"{diff} row(s) leaked" if diff > 0 else f"{-diff} row(s) over-counted"
            raise IntegrityError(
                f"free rows ({len(free)}) + held rows ({num_held}) != size ({self.size}): {what}"
            )

    def _check_row(self, row: int, action: str) -> None:
        if row == 0:
            raise ReservedSlotError(f"cannot {action} row 0: it is the padding row")
        if not 1 <= row <= self.size:
            raise IndexOutOfRangeError(f"cannot {action} row {row}: rows are 1..{self.size}")

    def __repr__(self) -> str:
        return (
            f"ReqToTokenPool(size={self.size}, max_context_len={self.max_context_len}, "
            f"free={len(self._free_rows)})"
        )
