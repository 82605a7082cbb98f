"""Attention: the layer models call, and backends (one per encoder-KV strategy)."""

from edserve.layers.attention.base import Attention, AttentionBackend
from edserve.layers.attention.registry import (
    BACKENDS,
    create_backend,
    resolve_page_size,
    supported_page_sizes,
)

__all__ = ["Attention", "AttentionBackend", "BACKENDS", "create_backend", "resolve_page_size",
           "supported_page_sizes"]
