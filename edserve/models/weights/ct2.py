"""A CTranslate2 Whisper folder -> an HF ``WhisperForConditionalGeneration`` config + state dict.

CTranslate2 names variables ``encoder/layer_0/self_attention/linear_0/weight`` where HF says
``model.encoder.layers.0.self_attn.q_proj.weight`` (``gamma``/``beta`` are LayerNorm
weight/bias; nothing is transposed; q is not pre-scaled). It fuses projections that HF keeps
apart, so the reader splits them by rows:

* ``self_attention/linear_0`` ``[3*d, d]`` -> ``self_attn.{q,k,v}_proj``
* ``attention/linear_1`` ``[2*d, d]`` (decoder cross-attention) -> ``encoder_attn.{k,v}_proj``

HF has no key-projection bias. Dropping it is exact whatever its value: ``q . b_k`` is the same
for every key of a query, so softmax cancels it (CTranslate2 stores zeros there anyway).
The output projection is tied to the token embedding, so it is not in the state dict.
Tensors keep the file's dtype (float16 for the embedded model); the caller converts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from edserve.models.weights.ct2_format import Ct2Model, read_ct2_model_bin
from edserve.models.weights.errors import WeightsError

# CTranslate2's ActivationType enum -> HF ACT2FN name.
_ACTIVATIONS = {
    0: "relu", 1: "gelu_new", 2: "silu", 3: "gelu", 4: "quick_gelu", 5: "tanh", 6: "sigmoid",
}
_MULTILINGUAL_MIN_VOCAB = 51865  # openai-whisper: English-only models have 51864 tokens


def _linear(src: str, dst: str, bias: bool = True) -> Iterator[tuple[str, str, slice | None]]:
    yield f"{dst}.weight", f"{src}/weight", None
    if bias:
        yield f"{dst}.bias", f"{src}/bias", None


def _norm(src: str, dst: str) -> Iterator[tuple[str, str, slice | None]]:
    yield f"{dst}.weight", f"{src}/gamma", None
    yield f"{dst}.bias", f"{src}/beta", None


def _fused(src: str, dsts: list[str], d: int) -> Iterator[tuple[str, str, slice | None]]:
    """Split rows of a fused projection; ``k_proj`` gets no bias (see the module docstring)."""
    for i, dst in enumerate(dsts):
        rows = slice(i * d, (i + 1) * d)
        yield f"{dst}.weight", f"{src}/weight", rows
        if not dst.endswith("k_proj"):
            yield f"{dst}.bias", f"{src}/bias", rows


def _layer_map(side: str, i: int, d: int) -> Iterator[tuple[str, str, slice | None]]:
    """(HF name, CT2 name, row slice) for one encoder or decoder layer."""
    src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
    attn = [f"{dst}.self_attn.{p}_proj" for p in "qkv"]
    yield from _fused(f"{src}/self_attention/linear_0", attn, d)
    yield from _linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
    yield from _norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
    if side == "decoder":
        cross = f"{dst}.encoder_attn"
        yield from _linear(f"{src}/attention/linear_0", f"{cross}.q_proj")
        yield from _fused(f"{src}/attention/linear_1", [f"{cross}.k_proj", f"{cross}.v_proj"], d)
        yield from _linear(f"{src}/attention/linear_2", f"{cross}.out_proj")
        yield from _norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
    yield from _linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
    yield from _linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
    yield from _norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")


def _name_map(n_enc: int, n_dec: int, d: int) -> Iterator[tuple[str, str, slice | None]]:
    for conv in ("conv1", "conv2"):
        yield from _linear(f"encoder/{conv}", f"model.encoder.{conv}")
    yield "model.encoder.embed_positions.weight", "encoder/position_encodings/encodings", None
    yield "model.decoder.embed_tokens.weight", "decoder/embeddings/weight", None
    yield "model.decoder.embed_positions.weight", "decoder/position_encodings/encodings", None
    for side, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            yield from _layer_map(side, i, d)
        yield from _norm(f"{side}/layer_norm", f"model.{side}.layer_norm")


def _count_layers(variables: dict[str, torch.Tensor], side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in variables:
        n += 1
    return n


def _scalar(model: Ct2Model, name: str, path: Path, default: int | None = None) -> int:
    if name not in model.variables:
        if default is None:
            raise WeightsError(f"{path}: missing scalar {name!r}")
        return default
    return int(model.variables[name].item())


def _read_folder_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(f"{path}: missing (a CTranslate2 folder needs config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from e


def _hf_config(model: Ct2Model, sd: dict[str, torch.Tensor], extra: dict, path: Path) -> dict:
    """The HF ``WhisperConfig`` fields, from tensor shapes, scalar variables and config.json."""
    activation = _scalar(model, "decoder/activation", path, default=3)
    if activation not in _ACTIVATIONS:
        raise WeightsError(f"{path}: unsupported activation code {activation}")
    for name, expected in (("decoder/pre_norm", 1), ("decoder/alibi", 0),
                           ("decoder/start_from_zero_embedding", 0)):
        if _scalar(model, name, path, default=expected) != expected:
            raise WeightsError(f"{path}: {name} != {expected} is not a Whisper layout")
    vocab_size, d_model = sd["model.decoder.embed_tokens.weight"].shape
    eot = 50257 if vocab_size >= _MULTILINGUAL_MIN_VOCAB else 50256
    n_enc = _count_layers(model.variables, "encoder")
    n_dec = _count_layers(model.variables, "decoder")
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": vocab_size,
        "num_mel_bins": sd["model.encoder.conv1.weight"].shape[1],
        "d_model": d_model,
        "encoder_layers": n_enc,
        "decoder_layers": n_dec,
        "encoder_attention_heads": _scalar(model, "encoder/num_heads", path),
        "decoder_attention_heads": _scalar(model, "decoder/num_heads", path),
        "encoder_ffn_dim": sd["model.encoder.layers.0.fc1.weight"].shape[0] if n_enc else 0,
        "decoder_ffn_dim": sd["model.decoder.layers.0.fc1.weight"].shape[0] if n_dec else 0,
        "max_source_positions": sd["model.encoder.embed_positions.weight"].shape[0],
        "max_target_positions": sd["model.decoder.embed_positions.weight"].shape[0],
        "activation_function": _ACTIVATIONS[activation],
        "scale_embedding": bool(_scalar(model, "decoder/scale_embeddings", path, default=0)),
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": eot + 1,  # <|startoftranscript|>
        "decoder_start_token_id": eot + 1,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "use_cache": True,
        "dtype": str(sd["model.decoder.embed_tokens.weight"].dtype).removeprefix("torch."),
    }
    for ct2_key, hf_key in (("suppress_ids", "suppress_tokens"),
                            ("suppress_ids_begin", "begin_suppress_tokens"),
                            ("alignment_heads", "alignment_heads"),
                            ("lang_ids", "lang_ids")):
        if ct2_key in extra:
            config[hf_key] = extra[ct2_key]
    return config


def read_ct2_whisper(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a CTranslate2 Whisper folder (``model.bin`` + ``config.json``).

    Returns ``(config, state_dict)``: an HF ``WhisperConfig`` dict and the tensors under HF
    ``WhisperForConditionalGeneration`` names (no ``proj_out.weight``: it is tied), in the
    file's dtype. Raises :class:`WeightsError` naming the file for anything unreadable.
    """
    folder = Path(folder)
    bin_path = folder / "model.bin"
    extra = _read_folder_config(folder / "config.json")
    model = read_ct2_model_bin(bin_path)
    if model.spec_name != "WhisperSpec":
        raise WeightsError(f"{bin_path}: spec {model.spec_name!r} is not WhisperSpec")
    variables = model.variables
    if "decoder/embeddings/weight" not in variables:
        raise WeightsError(f"{bin_path}: missing 'decoder/embeddings/weight'")
    d_model = variables["decoder/embeddings/weight"].shape[1]
    n_enc, n_dec = _count_layers(variables, "encoder"), _count_layers(variables, "decoder")
    state_dict: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for hf_name, ct2_name, rows in _name_map(n_enc, n_dec, d_model):
        if ct2_name not in variables:
            raise WeightsError(f"{bin_path}: missing variable {ct2_name!r}")
        tensor = variables[ct2_name]
        if not tensor.is_floating_point():
            raise WeightsError(f"{bin_path}: {ct2_name!r} is {tensor.dtype} (quantized models "
                               "are not supported; convert with --quantization float16)")
        state_dict[hf_name] = tensor if rows is None else tensor[rows].clone()
        used.add(ct2_name)
    unused = sorted(n for n, t in variables.items() if n not in used and t.dim() > 0)
    if unused:
        raise WeightsError(f"{bin_path}: unexpected variables {unused[:5]}")
    return _hf_config(model, state_dict, extra, bin_path), state_dict
