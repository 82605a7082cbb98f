"""The official ``openai-whisper`` package as a test oracle, on edserve's own weights.

:func:`openai_checkpoint` converts a CTranslate2 Whisper folder (the embedded tiny.en, the
``[base]`` extra's base; read by :func:`edserve.models.weights.load_checkpoint` under HF names)
into openai-whisper's checkpoint format, ``{"dims": ..., "model_state_dict": ...}`` (float32);
:func:`load_openai_whisper` saves it, loads it with ``whisper.load_model`` (a strict
``load_state_dict``: every tensor named, none left over) and sets the alignment heads from the
folder's ``config.json`` (``alignment_heads``: ``[layer, head]`` pairs). Nothing is downloaded:
openai-whisper's tokenizer and mel filters ship inside the package.

HF -> openai-whisper names (no transposes; openai-whisper's key projections have no bias, as
HF's): ``model.encoder.layers.L.self_attn.q_proj`` -> ``encoder.blocks.L.attn.query``,
``encoder_attn`` -> ``cross_attn``, ``fc1``/``fc2`` -> ``mlp.0``/``mlp.2``, ...
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from edserve.models.weights import load_checkpoint

# (HF name pattern, openai-whisper name), applied in order to each HF name (first match wins)
_RENAMES = [
    (r"model\.encoder\.embed_positions\.weight", "encoder.positional_embedding"),
    (r"model\.decoder\.embed_positions\.weight", "decoder.positional_embedding"),
    (r"model\.decoder\.embed_tokens\.weight", "decoder.token_embedding.weight"),
    (r"model\.encoder\.layer_norm\.", "encoder.ln_post."),
    (r"model\.decoder\.layer_norm\.", "decoder.ln."),
    (r"model\.encoder\.(conv[12])\.", r"encoder.\1."),
    (r"model\.(encoder|decoder)\.layers\.(\d+)\.", r"\1.blocks.\2."),
]
_BLOCK_PARTS = {  # inside one block, after the prefix above
    "self_attn.q_proj": "attn.query", "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value", "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query", "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value", "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0", "fc2": "mlp.2", "final_layer_norm": "mlp_ln",
}


def _openai_name(hf_name: str) -> str:
    for pattern, repl in _RENAMES:
        name, n = re.subn(f"^{pattern}", repl, hf_name)
        if n:
            break
    else:
        raise KeyError(f"no openai-whisper name for {hf_name!r}")
    if m := re.fullmatch(r"((?:encoder|decoder)\.blocks\.\d+\.)(.+)\.(weight|bias)", name):
        prefix, part, kind = m.groups()
        name = f"{prefix}{_BLOCK_PARTS[part]}.{kind}"
    return name


def openai_checkpoint(model: str) -> dict:
    """``{"dims": ModelDimensions fields, "model_state_dict": float32 tensors}`` of ``model``
    (a name such as ``tiny.en`` / ``base`` or a CTranslate2 / HF Whisper folder)."""
    ckpt = load_checkpoint(model)
    c = ckpt.config
    dims = dict(n_mels=c["num_mel_bins"], n_audio_ctx=c["max_source_positions"],
                n_audio_state=c["d_model"], n_audio_head=c["encoder_attention_heads"],
                n_audio_layer=c["encoder_layers"], n_vocab=c["vocab_size"],
                n_text_ctx=c["max_target_positions"], n_text_state=c["d_model"],
                n_text_head=c["decoder_attention_heads"], n_text_layer=c["decoder_layers"])
    state = {_openai_name(k): v.float().contiguous() for k, v in ckpt.state_dict.items()}
    return {"dims": dims, "model_state_dict": state}


def alignment_heads_dump(folder: Path, n_layers: int, n_heads: int) -> bytes:
    """The folder's ``config.json`` ``alignment_heads`` as openai-whisper's ``_ALIGNMENT_HEADS``
    encoding (base85 of the gzipped dense ``[n_layers, n_heads]`` bool mask)."""
    pairs = json.loads((folder / "config.json").read_text(encoding="utf-8"))["alignment_heads"]
    mask = np.zeros((n_layers, n_heads), dtype=bool)
    for layer, head in pairs:
        mask[layer, head] = True
    return base64.b85encode(gzip.compress(mask.tobytes()))


def load_openai_whisper(model: str, path: Path):
    """openai-whisper's ``Whisper`` (CPU, float32, eval) on ``model``'s weights, saved to and
    loaded from ``path`` by ``whisper.load_model`` (strict), with the folder's alignment heads."""
    import whisper

    from edserve.models.catalog import resolve_model

    ckpt = openai_checkpoint(model)
    torch.save(ckpt, path)
    oracle = whisper.load_model(str(path), device="cpu").float().eval()
    dims = ckpt["dims"]
    assert asdict(oracle.dims) == dims
    oracle.set_alignment_heads(alignment_heads_dump(resolve_model(model), dims["n_text_layer"],
                                                    dims["n_text_head"]))
    return oracle
