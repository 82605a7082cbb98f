"""HF ``generate`` reference runs (greedy, exactly ``steps`` new tokens, raw logits)."""

from __future__ import annotations

import torch

from edserve.multimodal.mllama_image import MllamaImageInput


def hf_cross_mask(prompt: list[int], image_token: int, num_tiles: tuple[int, ...],
                  max_tiles: int = 4) -> torch.Tensor:
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )
    sparse = get_cross_attention_token_mask(prompt, image_token)
    dense = convert_sparse_cross_attention_mask_to_dense([sparse], [list(num_tiles)], max_tiles,
                                                         len(prompt))
    return torch.from_numpy(dense)  # [1, S, N_img, T]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], image: MllamaImageInput | None,
              steps: int = 10) -> tuple[list[int], torch.Tensor]:
    """Tokens and raw logits ``[steps, vocab]`` of a solo HF run."""
    ids = torch.tensor([prompt])
    kw = {}
    if image is not None:
        kw = dict(pixel_values=image.pixel_values[None],
                  aspect_ratio_ids=image.aspect_ratio_ids[None],
                  aspect_ratio_mask=image.aspect_ratio_mask[None],
                  cross_attention_mask=hf_cross_mask(prompt, hf.config.image_token_index,
                                                     image.num_tiles))
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                      return_dict_in_generate=True, **kw)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat(out.logits).float()
