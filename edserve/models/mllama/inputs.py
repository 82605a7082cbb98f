"""What an Mllama request needs from the model before it reaches the engine: config only.

The chat API turns a prompt and its images into a :class:`~edserve.engine.request.
GenerateRequest` with the model's image settings, ``<|image|>`` token and per-token
cross-attention ranges, and validates the images against the model. None of that reads a
weight, so it lives here, on :class:`MllamaInputs` (a mixin over ``self.config``):
:class:`~edserve.models.mllama.model.MllamaModel` has it, and so has :class:`MllamaFacts`, the
config-only stand-in an API process uses when the model lives in engine worker processes.
"""

from __future__ import annotations

from typing import Any

from edserve.models.mllama.config import MllamaConfig
from edserve.multimodal.errors import ImageInputError
from edserve.multimodal.mllama_image import MllamaImageConfig, MllamaImageInput
from edserve.multimodal.mllama_prompt import CrossAttentionLayout, build_cross_attention_layout


class MllamaInputs:
    """Request preparation and validation from ``self.config`` (an :class:`MllamaConfig`)."""

    config: MllamaConfig

    @property
    def patches_per_tile(self) -> int:
        return self.config.vision.num_patches

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_index

    @property
    def max_encoder_len(self) -> int:
        return self.config.max_images * self.config.vision.max_num_tiles * self.patches_per_tile

    def encoder_len(self, image_input: Any) -> int:
        """Encoder-region keys of a request: sum(valid tiles) * P (N_img * T * P when padding
        tiles are stored for ``cross_attention_empty_rows == "hf"``); 0 for text-only.
        Raises :class:`ImageInputError` for an input this model cannot take."""
        if image_input is None:
            return 0
        if not isinstance(image_input, MllamaImageInput):
            raise ImageInputError(f"Mllama expects preprocessed images (MllamaImageInput), got "
                                  f"{type(image_input).__name__}")
        n, vc = image_input.num_images, self.config.vision
        if n > self.config.max_images:
            raise ImageInputError(f"too many images: {n} given, at most "
                                  f"{self.config.max_images} per request")
        if tuple(image_input.pixel_values.shape[1:]) != (vc.max_num_tiles, vc.num_channels,
                                                         vc.image_size, vc.image_size):
            raise ImageInputError(f"pixel_values of shape {list(image_input.pixel_values.shape)}"
                                  f" do not fit the model's {vc.max_num_tiles} tiles of "
                                  f"{vc.image_size}px")
        if self.config.cross_attention_empty_rows == "hf":
            return n * vc.max_num_tiles * self.patches_per_tile
        return sum(image_input.num_tiles) * self.patches_per_tile

    @property
    def image_config(self) -> MllamaImageConfig:
        """Preprocessing settings that fit this model (CLIP mean/std, bilinear)."""
        vc = self.config.vision
        return MllamaImageConfig(image_size=vc.image_size, max_image_tiles=vc.max_num_tiles,
                                 max_images=self.config.max_images,
                                 aspect_ratios=vc.aspect_ratios)

    def cross_attention_layout(self, prompt_ids: list[int],
                               image_input: MllamaImageInput | None) -> CrossAttentionLayout:
        """Per-token visible encoder ranges of a prompt (checks the ``<|image|>`` count)."""
        tiles = image_input.num_tiles if image_input is not None else ()
        return build_cross_attention_layout(prompt_ids, self.image_token_id, tiles,
                                            self.patches_per_tile)


class MllamaFacts(MllamaInputs):
    """The model's request-side facts without weights (pickles with its config)."""

    def __init__(self, config: MllamaConfig) -> None:
        self.config = config
