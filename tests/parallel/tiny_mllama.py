"""The tiny Mllama of ``mllama-facts.md`` section 4 with seeded random weights, in memory (our
own ``MllamaModel`` init, as ``benchmarks/mllama_gpu.py`` does; no HF import), and requests."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from mllama_random import random_state_dict  # noqa: E402

from edserve.models.weights import Checkpoint  # noqa: E402
from tests.models.mllama.hf_tiny import TINY_CONFIG, synthetic_image  # noqa: E402


def save_tiny_folder(checkpoint: Checkpoint, folder: Path) -> Path:
    """``checkpoint`` as an HF folder (``config.json`` + ``model.safetensors`` under the
    model's own names, which the loader accepts) with the tiny chat tokenizer."""
    import json

    from safetensors.torch import save_file

    from tests.models.mllama.chat_tiny import save_chat_tokenizer

    save_file({k: v.contiguous() for k, v in checkpoint.state_dict.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(checkpoint.config))
    return save_chat_tokenizer(folder)


def tiny_checkpoint() -> Checkpoint:
    config = dict(copy.deepcopy(TINY_CONFIG), model_type="mllama")
    sd = random_state_dict(config, "cpu", torch.float32)
    return Checkpoint(Path("<tiny mllama>"), "hf", config, sd, Path("/nonexistent"))


SIZES = [(50, 40), (100, 50), (150, 50), (300, 40)]  # 1, 2, 3, 4 tiles at 56 px


def tiny_cases() -> list[tuple[list[int], list]]:
    """(prompt ids, PIL images): 1-4 tile images, text before an image, two images, text-only
    (image token 128, BOS 1)."""
    out = [([128, 1, 15 + i, 13, 14], [synthetic_image(w, h, seed=i)])
           for i, (w, h) in enumerate(SIZES)]
    out.append(([1, 20, 21, 128, 22, 23], [synthetic_image(120, 120, 5)]))
    out.append(([128, 128, 1, 16, 17], [synthetic_image(100, 50, 9),
                                         synthetic_image(120, 120, 8)]))
    return out + [([1, 18, 19, 10, 11, 13], []), ([1, 20, 9], [])]
