"""Host<->device syncs while a function runs, for the GPU tests (``torch.cuda`` sync debug
mode: every synchronizing CUDA call warns; the warnings are counted)."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import torch


def sync_sites(fn) -> Counter:
    """Syncs while ``fn()`` runs, counted by the Python line that waited (``file:line``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                   if "called a synchronizing" in str(w.message))


def count_syncs(fn) -> int:
    """Number of syncs while ``fn()`` runs."""
    return sum(sync_sites(fn).values())
