"""Turn a tokenized Mllama prompt + its images into an engine :class:`GenerateRequest`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.multimodal.image_io import ImageSource
from edserve.multimodal.mllama_image import preprocess_images


def make_mllama_request(model: Any, prompt_ids: Sequence[int], images: Sequence[ImageSource],
                        sampling: SamplingParams | None = None,
                        image_config: Any = None) -> GenerateRequest:
    """Preprocess ``images`` for ``model`` (an ``MllamaModel``), check the ``<|image|>`` count,
    and attach the per-token cross-attention ranges. Raises ``ImageInputError`` on bad input.

    ``prompt_ids`` must already hold one ``<|image|>`` token per image (HF's processor also
    moves leading ``<|image|>`` tokens before a missing BOS; templating is the caller's job).
    """
    image_input = preprocess_images(list(images), image_config or model.image_config)
    layout = model.cross_attention_layout(list(prompt_ids), image_input)
    ranges = [tuple(r) for r in layout.ranges.tolist()] if image_input is not None else None
    model.encoder_len(image_input)  # validates against the model (tiles, size, image count)
    return GenerateRequest(prompt_ids=list(prompt_ids), encoder_input=image_input,
                           cross_kv_ranges=ranges, sampling=sampling or SamplingParams())
