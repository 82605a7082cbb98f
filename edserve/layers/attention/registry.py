"""Attention backends by encoder-KV strategy name, and page-size resolution."""

from __future__ import annotations

from edserve.layers.attention.aligned import AlignedBackend
from edserve.layers.attention.encdec import EncoderDecoderBackend
from edserve.layers.attention.flat import FlatBackend
from edserve.layers.attention.ops import get_ops
from edserve.layers.attention.ragged import RaggedBackend

BACKENDS: dict[str, type[EncoderDecoderBackend]] = {
    "aligned": AlignedBackend,
    "ragged": RaggedBackend,
    "flat": FlatBackend,
}

# Page size used for ``--page-size auto``, per (strategy, ops).
_DEFAULT_PAGE_SIZE = {"torch": 1, "triton": 128}


def supported_page_sizes(strategy: str, ops: str,
                         restrict: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """Page sizes a strategy accepts with an op set (None = any), intersected with ``restrict``."""
    sizes = get_ops(ops).paged_page_sizes if strategy == "aligned" else None
    if restrict:
        sizes = tuple(s for s in (sizes or restrict) if s in restrict)
    return sizes


def resolve_page_size(requested: str | int, strategy: str, ops: str,
                      restrict: tuple[int, ...] | None = None) -> int:
    """``auto`` -> the backend's default; an explicit unsupported size -> ValueError."""
    sizes = supported_page_sizes(strategy, ops, restrict)
    if str(requested) == "auto":
        default = _DEFAULT_PAGE_SIZE[ops]
        if sizes is not None and default not in sizes:
            default = max(sizes)
        return default
    try:
        page_size = int(requested)
    except ValueError:
        raise ValueError(f"--page-size must be a positive integer or 'auto', got {requested!r}") \
            from None
    if page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {page_size}")
    if sizes is not None and page_size not in sizes:
        raise ValueError(
            f"page size {page_size} is not supported by the {strategy!r} strategy with the "
            f"{ops!r} attention kernels; supported: {list(sizes)} (or use --page-size auto)")
    return page_size


def create_backend(name: str, page_size: int, ops: str = "torch",
                   grouped_cross: bool = True) -> EncoderDecoderBackend:
    """``grouped_cross``: decode reads a row group's encoder region once with the grouped
    kernel where the strategy and op set have one (see ``EncoderDecoderBackend``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown encoder-KV strategy {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](page_size, get_ops(ops), grouped_cross)
