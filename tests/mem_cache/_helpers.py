"""Small shared helpers for the mem_cache tests."""

from __future__ import annotations

import torch


class Req:
    """The duck-typed request the pools accept; ``slots`` is the test's model of its row."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.req_pool_idx: int | None = None
        self.slots: list[int] = []


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def snapshot(allocator) -> tuple[list[int], list[bool], list[int]]:
    """Free list, free mask and refcounts of an allocator, for before/after comparisons."""
    return (allocator.free_pages().tolist(), allocator.book.is_free.tolist(),
            allocator.refcounts().tolist())
