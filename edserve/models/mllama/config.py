"""Frozen Mllama (Llama-3.2-Vision) configuration, read from an HF ``config.json`` dict.

Two parity switches live on :class:`MllamaConfig` (neither is part of HF's config):

``vision_intermediate_semantics``
    ``"hf"`` (default): intermediate feature ``i`` is the *output* of local vision layer ``i``
    (HF transformers 5.24). ``"meta"``: the *input* of layer ``i`` (Meta's reference and vLLM;
    use it for real checkpoints). HF-5.24 index ``i`` equals Meta index ``i + 1``.
``cross_attention_empty_rows``
    How a text token that sees no image (tokens before the first ``<|image|>``) is treated
    inside a request that has images. ``"zero"`` (default, Meta/vLLM): both the cross-attention
    and the MLP branch of every cross layer are zeroed. ``"hf"``: HF 5.24's quirk: the token
    attends over *all* of the request's encoder keys, padding tiles included (so padding-tile
    keys are stored after the valid tiles and ``encoder_len`` becomes ``N_img * T * P``); its
    attention output is kept and only the MLP branch is zeroed. Text-only requests
    (``encoder_len == 0``) skip the cross layers' contribution entirely in both modes, which is
    what HF does when there are no pixel values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edserve.multimodal.mllama_image import supported_aspect_ratios

VISION_INTERMEDIATE_SEMANTICS = ("hf", "meta")
CROSS_ATTENTION_EMPTY_ROWS = ("zero", "hf")


@dataclass(frozen=True)
class MllamaVisionConfig:
    hidden_size: int = 1280
    attention_heads: int = 16
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_global_layers: int = 8
    num_channels: int = 3
    image_size: int = 560
    patch_size: int = 14
    max_num_tiles: int = 4
    intermediate_layers_indices: tuple[int, ...] = (3, 7, 15, 23, 30)
    vision_output_dim: int = 7680
    norm_eps: float = 1e-5
    supported_aspect_ratios: tuple[tuple[int, int], ...] = ()  # () = default for max_num_tiles

    @property
    def aspect_ratios(self) -> tuple[tuple[int, int], ...]:
        return self.supported_aspect_ratios or supported_aspect_ratios(self.max_num_tiles)

    @property
    def num_patches(self) -> int:
        """Keys per tile P: patches + CLS."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> MllamaVisionConfig:
        kw = {k: d[k] for k in ("hidden_size", "attention_heads", "intermediate_size",
                                "num_hidden_layers", "num_global_layers", "num_channels",
                                "image_size", "patch_size", "max_num_tiles",
                                "vision_output_dim", "norm_eps") if d.get(k) is not None}
        if d.get("intermediate_layers_indices") is not None:
            kw["intermediate_layers_indices"] = tuple(d["intermediate_layers_indices"])
        if d.get("supported_aspect_ratios"):
            kw["supported_aspect_ratios"] = tuple(tuple(a) for a in d["supported_aspect_ratios"])
        act = d.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported vision hidden_act {act!r} (only exact gelu)")
        cfg = cls(**kw)
        want = cfg.hidden_size * (1 + len(cfg.intermediate_layers_indices))
        if cfg.vision_output_dim != want:
            raise ValueError(f"vision_output_dim {cfg.vision_output_dim} != hidden_size * "
                             f"(1 + len(intermediate_layers_indices)) = {want}")
        return cfg


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "llama3"  # "llama3" or "default"
    theta: float = 500000.0
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> RopeConfig:
        """HF 5 ``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``."""
        params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = params.get("rope_theta", d.get("rope_theta", 500000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("llama3", "default"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        if rope_type == "default":
            return cls(rope_type="default", theta=float(theta))
        return cls(rope_type="llama3", theta=float(theta), factor=float(params["factor"]),
                   low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(params.get(
                       "original_max_position_embeddings",
                       d.get("max_position_embeddings", 8192))))


@dataclass(frozen=True)
class MllamaTextConfig:
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 40
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    cross_attention_layers: tuple[int, ...] = (3, 8, 13, 18, 23, 28, 33, 38)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int = 128000
    eos_token_id: tuple[int, ...] = (128001,)
    pad_token_id: int | None = 128004
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> MllamaTextConfig:
        kw = {k: d[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "rms_norm_eps",
                                "max_position_embeddings", "bos_token_id", "pad_token_id",
                                "tie_word_embeddings") if d.get(k) is not None}
        if d.get("cross_attention_layers") is not None:
            kw["cross_attention_layers"] = tuple(d["cross_attention_layers"])
        eos = d.get("eos_token_id")
        if eos is not None:
            kw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported text hidden_act {act!r} (only silu)")
        return cls(rope=RopeConfig.from_hf(d), **kw)


@dataclass(frozen=True)
class MllamaConfig:
    text: MllamaTextConfig = field(default_factory=MllamaTextConfig)
    vision: MllamaVisionConfig = field(default_factory=MllamaVisionConfig)
    image_token_index: int = 128256
    vision_intermediate_semantics: str = "hf"  # see module docstring
    cross_attention_empty_rows: str = "zero"  # see module docstring
    max_images: int = 4  # images per request (sizes the encoder region of a row)

    def __post_init__(self) -> None:
        if self.vision_intermediate_semantics not in VISION_INTERMEDIATE_SEMANTICS:
            raise ValueError(f"vision_intermediate_semantics must be one of "
                             f"{VISION_INTERMEDIATE_SEMANTICS}")
        if self.cross_attention_empty_rows not in CROSS_ATTENTION_EMPTY_ROWS:
            raise ValueError(f"cross_attention_empty_rows must be one of "
                             f"{CROSS_ATTENTION_EMPTY_ROWS}")

    @property
    def eos_token_id(self) -> int:
        """The first end-of-text id (the engine's stop token); see ``stop_token_ids``."""
        return self.text.eos_token_id[0]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every end-of-text id (Instruct: 128001, 128008, 128009)."""
        return self.text.eos_token_id

    @classmethod
    def from_hf(cls, d: dict[str, Any], **switches: Any) -> MllamaConfig:
        """From an HF ``config.json`` dict; ``switches`` sets the fields HF's config lacks
        (the two parity switches, ``max_images``)."""
        return cls(text=MllamaTextConfig.from_hf(d.get("text_config") or {}),
                   vision=MllamaVisionConfig.from_hf(d.get("vision_config") or {}),
                   image_token_index=int(d.get("image_token_index",
                                               d.get("image_token_id", 128256))),
                   **switches)
