"""What an :class:`~edserve.engine.engine.Engine` is built from.

The composition root (:mod:`edserve.runtime`) resolves the config, loads and builds the model,
sizes the pools and captures the graphs, then hands the pieces over in one ``EngineParts``; the
engine itself loads nothing and imports nothing from ``edserve.models``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edserve.config import EngineConfig
from edserve.engine.batch_builder import Pools
from edserve.engine.cpu_compile import CompiledDecodeRunner
from edserve.engine.cuda_graph import DecodeGraphRunner


@dataclass(frozen=True)
class EngineParts:
    """``config`` is resolved: ``max_running_requests`` is the concrete running limit."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    threads: int | None  # torch CPU threads set at start (None on CUDA)
    page_size: int
    model: Any  # an encoder-decoder model (edserve.models): forward, encoder_len, config
    tokenizer: Any
    pools: Pools
    max_decoder_len: int  # decoder positions per request
    max_prefill_tokens: int  # encoder + prompt tokens admitted in one prefill step
    max_mixed_prefill_tokens: int  # the same in a step while rows are running
    # captured decode graphs (CUDA) or compiled decode steps (CPU)
    graphs: DecodeGraphRunner | CompiledDecodeRunner | None = None
