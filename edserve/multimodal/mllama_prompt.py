"""Which encoder keys each Mllama text token may attend to (HF ``get_cross_attention_token_mask``).

Compact encoder layout of one request (what the KV pool's encoder region holds): keys ordered
(image, tile, patch), only the valid tiles of each image stored, so image ``k`` occupies
``[sum_{k'<k} tiles_k' * P, sum_{k'<=k} tiles_k' * P)`` with ``P`` keys (patches + CLS) per tile.

Visibility rules (HF processor semantics):
  * image ``k`` is visible from its ``<|image|>`` token (inclusive) up to the next
    ``<|image|>`` token, or to the end of the prompt for the last image;
  * consecutive ``<|image|>`` tokens form a group: every image of the group stays visible to
    all text that follows the group (until the next group);
  * tokens before the first ``<|image|>`` see nothing: range ``(0, 0)``;
  * generated (decode) tokens use the last prompt token's range.
The visible images of a token are always consecutive, so one ``(start, end)`` range per token
describes them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edserve.multimodal.errors import ImageInputError


@dataclass(frozen=True)
class CrossAttentionLayout:
    """Per-request cross-attention visibility over the compact encoder layout."""

    ranges: torch.Tensor  # [S_prompt, 2] int32: visible key range (start, end) per prompt token
    encoder_len: int  # sum(num_tiles) * P: keys in the compact layout
    image_offsets: tuple[int, ...]  # [N_img + 1] key offset of each image; last = encoder_len

    def ranges_for(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, 2]`` int32 ranges for decoder positions (past the prompt: the last row)."""
        S = self.ranges.shape[0]
        if S == 0:
            return torch.zeros(positions.shape[0], 2, dtype=torch.int32)
        return self.ranges[positions.long().clamp(min=0, max=S - 1).cpu()]


def image_token_spans(prompt_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` from which each image is visible (HF's algorithm, end exclusive)."""
    locs = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    n = len(prompt_ids)
    if not locs:
        return []
    spans = [[a, b] for a, b in zip(locs[:-1], locs[1:], strict=True)] + [[locs[-1], n]]
    last_end = spans[-1][1]
    for span in reversed(spans):  # consecutive image tokens: the group sees all following text
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return [(a, b) for a, b in spans]


def build_cross_attention_layout(prompt_ids: Sequence[int], image_token_id: int,
                                 num_tiles: Sequence[int],
                                 patches_per_tile: int) -> CrossAttentionLayout:
    """Visible compact-encoder key range of every prompt token.

    Raises :class:`ImageInputError` when the number of ``<|image|>`` tokens differs from the
    number of images.
    """
    spans = image_token_spans(prompt_ids, image_token_id)
    if len(spans) != len(num_tiles):
        raise ImageInputError(
            f"the prompt has {len(spans)} <|image|> token(s) but {len(num_tiles)} image(s) were "
            "given; they must match")
    offsets = [0]
    for n in num_tiles:
        offsets.append(offsets[-1] + int(n) * patches_per_tile)
    S = len(prompt_ids)
    ranges = torch.zeros(S, 2, dtype=torch.int32)
    if spans:
        starts = torch.tensor([a for a, _ in spans])
        ends = torch.tensor([b for _, b in spans])
        rows = torch.arange(S)
        vis = (starts[None, :] <= rows[:, None]) & (rows[:, None] < ends[None, :])  # [S, N_img]
        any_vis = vis.any(dim=1)
        first = torch.where(any_vis, vis.int().argmax(dim=1), 0)
        last = torch.where(any_vis, len(spans) - 1 - vis.int().flip(1).argmax(dim=1), -1)
        # Visible images are consecutive (starts increase, ends never decrease).
        assert bool((vis.sum(dim=1) == (last - first + 1).clamp(min=0)).all())
        off = torch.tensor(offsets, dtype=torch.int32)
        ranges[:, 0] = torch.where(any_vis, off[first], 0)
        ranges[:, 1] = torch.where(any_vis, off[(last + 1).clamp(min=0)], 0)
    return CrossAttentionLayout(ranges=ranges, encoder_len=offsets[-1],
                                image_offsets=tuple(offsets))
