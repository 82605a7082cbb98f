"""The tiny random Mllama of ``mllama-facts.md`` section 4, built with HF transformers (test-only
oracle) and saved as an HF folder our loader reads."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

TINY_CONFIG = {
    "image_token_index": 128,
    "text_config": {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "cross_attention_layers": [2],
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    "vision_config": {
        "hidden_size": 32, "attention_heads": 4, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_global_layers": 1, "image_size": 56, "patch_size": 14,
        "max_num_tiles": 4, "intermediate_layers_indices": [0, 1], "vision_output_dim": 96,
        "norm_eps": 1e-5},
}

# Prompts of the facts' parity table (image token 128).
CHAT_IDS = [1, 3, 8, 4, 128, 15, 13, 14, 5, 3, 9, 4]
IMAGE_FIRST_IDS = [128, 1, 15, 13, 14]
TEXT_ONLY_IDS = [1, 18, 19, 10, 11, 13]
TWO_IMAGE_IDS = [128, 128, 1, 15, 16, 17]


def build_hf_tiny(config: dict | None = None):
    """HF ``MllamaForConditionalGeneration``: seed 0, then every scalar gate U(0.5, 1.5)."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(0)
    cfg = MllamaConfig(**copy.deepcopy(config or TINY_CONFIG))
    cfg._attn_implementation = "sdpa"
    model = MllamaForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.copy_(torch.rand(1, generator=gen) + 0.5)
    return model


def save_hf_tiny(model, folder: Path) -> Path:
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def hf_image_processor(image_size: int):
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    from edserve.multimodal.mllama_image import CLIP_MEAN, CLIP_STD
    return MllamaImageProcessorPil(size={"height": image_size, "width": image_size},
                                   max_image_tiles=4, image_mean=list(CLIP_MEAN),
                                   image_std=list(CLIP_STD), resample=2)


def synthetic_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB PIL image with structure (gradients + noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([(xx * 255 // max(width - 1, 1)), (yy * 255 // max(height - 1, 1)),
                    rng.integers(0, 256, size=(height, width))], axis=-1).astype(np.uint8)
    return Image.fromarray(arr, mode="RGB")


def save_word_tokenizer(folder: Path) -> Path:
    """A made-up WordLevel ``tokenizer.json`` over the tiny vocabulary (ids 0..128)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {f"w{i}": i for i in range(128)}
    vocab["<|image|>"] = 128
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder
