"""Registry entry point (``edserve.models.registry``): checkpoint -> (model, tokenizer)."""

from __future__ import annotations

from typing import Any

import torch

from edserve.models.mllama.model import MllamaModel
from edserve.models.mllama.weights import build_from_state_dict


def build_mllama(checkpoint: Any, dtype: torch.dtype, device: torch.device,
                 **switches: Any) -> tuple[MllamaModel, Any]:
    """``checkpoint``: ``edserve.models.weights.Checkpoint`` (HF config dict + HF-named
    tensors). The tokenizer is the folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``
    (None when absent); chat templating is not done here."""
    model = build_from_state_dict(checkpoint.config, checkpoint.state_dict, dtype, device,
                                  **switches)
    return model, load_tokenizer(checkpoint)


def load_tokenizer(checkpoint: Any) -> Any:
    """The checkpoint folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None."""
    path = getattr(checkpoint, "tokenizer_path", None)
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))
