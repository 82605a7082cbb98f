"""Cross-attention visibility ranges agree with HF's processor mask, on the compact layout."""

from __future__ import annotations

import random

import pytest
import torch

from edserve.multimodal import ImageInputError
from edserve.multimodal.mllama_prompt import build_cross_attention_layout

IMG = 128
P = 17


def _hf_dense(ids: list[int], num_tiles: list[int]) -> torch.Tensor:
    """HF processor mask ``[S, N_img, T]`` (T = 4)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )
    sparse = get_cross_attention_token_mask(ids, IMG)
    dense = convert_sparse_cross_attention_mask_to_dense([sparse], [num_tiles], 4, len(ids))
    return torch.from_numpy(dense[0])


def _compact_mask(ids: list[int], num_tiles: list[int]) -> torch.Tensor:
    """Our ranges as a dense ``[S, E]`` bool mask over the compact keys."""
    lay = build_cross_attention_layout(ids, IMG, num_tiles, P)
    j = torch.arange(lay.encoder_len)
    r = lay.ranges.long()
    return (j[None] >= r[:, :1]) & (j[None] < r[:, 1:])


def _hf_compact(ids: list[int], num_tiles: list[int]) -> torch.Tensor:
    """HF's mask restricted to valid tiles, flattened in (image, tile, patch) order."""
    dense = _hf_dense(ids, num_tiles)
    cols = [dense[:, i, t] for i, n in enumerate(num_tiles) for t in range(n)]
    if not cols:
        return torch.zeros(len(ids), 0, dtype=torch.bool)
    return torch.stack(cols, 1).repeat_interleave(P, dim=1).bool()


CASES = [
    ([1, 3, 8, 4, IMG, 15, 13, 14, 5, 3, 9, 4], [2]),  # chat: rows 0-3 see nothing
    ([IMG, 1, 15, 13, 14], [2]),  # image first
    ([IMG, IMG, 1, 15, 16, 17], [2, 4]),  # consecutive group
    ([1, IMG, 5, 6, IMG, 7, 8], [1, 3]),  # separate images
    ([IMG, IMG, 5, IMG, 6, IMG, IMG, 7], [1, 2, 3, 4, 1]),  # mixed groups
    ([5, 6, IMG], [4]),  # image token last
    ([1, 18, 19, 10], []),  # text-only
]


@pytest.mark.parametrize("ids,tiles", CASES)
def test_matches_hf_processor(ids, tiles):
    pytest.importorskip("transformers")
    assert torch.equal(_compact_mask(ids, tiles), _hf_compact(ids, tiles))


def test_random_prompts_match_hf():
    pytest.importorskip("transformers")
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([IMG, IMG, 3, 4, 5]) for _ in range(rng.randint(1, 12))]
        tiles = [rng.randint(1, 4) for _ in range(ids.count(IMG))]
        assert torch.equal(_compact_mask(ids, tiles), _hf_compact(ids, tiles)), (ids, tiles)


def test_chat_ranges_and_decode_rows():
    lay = build_cross_attention_layout(CASES[0][0], IMG, [2], P)
    assert lay.encoder_len == 2 * P
    assert lay.ranges[:4].tolist() == [[0, 0]] * 4
    assert lay.ranges[4:].tolist() == [[0, 2 * P]] * 8
    two = build_cross_attention_layout([1, IMG, 5, IMG, 7], IMG, [1, 3], P)
    assert two.image_offsets == (0, P, 4 * P)
    # decode positions past the prompt use the last prompt row
    assert two.ranges_for(torch.tensor([0, 1, 2, 4, 5, 9])).tolist() == [
        [0, 0], [0, P], [0, P], [P, 4 * P], [P, 4 * P], [P, 4 * P]]


def test_text_only_layout():
    lay = build_cross_attention_layout([1, 2, 3], IMG, [], P)
    assert lay.encoder_len == 0 and lay.ranges.tolist() == [[0, 0]] * 3


@pytest.mark.parametrize("ids,tiles", [([IMG, 1], []), ([1, 2], [1]), ([IMG, IMG, 1], [2])])
def test_image_count_mismatch(ids, tiles):
    with pytest.raises(ImageInputError, match="must match"):
        build_cross_attention_layout(ids, IMG, tiles, P)
