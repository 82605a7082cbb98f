"""Mllama image preprocessing: identical to HF ``MllamaImageProcessorPil``; input errors."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from edserve.multimodal import ImageInputError
from edserve.multimodal.image_io import load_image
from edserve.multimodal.mllama_image import (
    MllamaImageConfig,
    fit_to_canvas,
    optimal_canvas,
    preprocess_images,
    stack_pixels,
    supported_aspect_ratios,
)
from tests.models.mllama.hf_tiny import hf_image_processor, synthetic_image

pytest.importorskip("transformers")

# (W, H) -> expected (num_tiles, aspect-ratio id) at tile size 56 (facts table).
FACTS_CASES = [((100, 50), 2, 2), ((50, 100), 2, 5), ((120, 120), 4, 6), ((300, 40), 4, 4)]


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _compare_with_hf(images: list[Image.Image], size: int) -> None:
    ours = preprocess_images(images, MllamaImageConfig(image_size=size))
    hf = hf_image_processor(size)(images=[images], return_tensors="pt")
    assert torch.equal(ours.pixel_values, hf["pixel_values"][0])
    assert torch.equal(ours.aspect_ratio_ids, hf["aspect_ratio_ids"][0])
    assert torch.equal(ours.aspect_ratio_mask, hf["aspect_ratio_mask"][0])
    assert list(ours.num_tiles) == list(hf["num_tiles"][0])


@pytest.mark.parametrize("wh,tiles,ar_id", FACTS_CASES)
def test_facts_table_tiny(wh, tiles, ar_id):
    img = synthetic_image(*wh, seed=wh[0])
    out = preprocess_images([img], MllamaImageConfig(image_size=56))
    assert out.num_tiles == (tiles,)
    assert out.aspect_ratio_ids.tolist() == [ar_id]
    assert out.aspect_ratio_mask[0].tolist() == [1] * tiles + [0] * (4 - tiles)
    assert out.pixel_values.shape == (1, 4, 3, 56, 56)
    assert torch.count_nonzero(out.pixel_values[0, tiles:]) == 0
    _compare_with_hf([img], 56)


@pytest.mark.parametrize("wh", [(100, 50), (50, 100), (300, 40), (800, 600), (1000, 1000),
                                (561, 200), (30, 2000), (560, 560)])
def test_matches_hf_real_size(wh):
    _compare_with_hf([synthetic_image(*wh, seed=7)], 560)


def test_multi_image_and_modes_match_hf():
    imgs = [synthetic_image(100, 50, 1), synthetic_image(130, 140, 2).convert("L"),
            synthetic_image(60, 70, 3).convert("RGBA")]
    _compare_with_hf(imgs, 56)


def test_padding_is_normalised_zero():
    out = preprocess_images([synthetic_image(100, 50)], MllamaImageConfig(image_size=56))
    # 100x50 stays 100x50 on a 56x112 canvas: rows 50.. and cols 100.. are padding.
    pad = out.pixel_values[0, 0, :, 55, 0]
    assert torch.allclose(pad, torch.tensor([-1.7923, -1.7521, -1.4802]), atol=1e-4)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_pixels_equals_the_concatenation_and_reads_valid_tiles_only(staged, dtype):
    """What the vision tower gets: the concatenated pixel values cast to the model dtype
    (through the staging buffer or not); padding tiles come out zero even when the input's
    are poisoned, because they are never read."""
    cfg = MllamaImageConfig(image_size=56)
    reqs = [preprocess_images([synthetic_image(50, 40, 1)], cfg),  # 1 tile
            preprocess_images([synthetic_image(100, 50, 2), synthetic_image(300, 40, 3)], cfg)]
    want = torch.cat([r.pixel_values for r in reqs]).to(dtype)  # [3, 4, 3, 56, 56]
    for r in reqs:  # tiles past num_tiles: NaN (never read)
        for j, t in enumerate(r.num_tiles):
            r.pixel_values[j, t:] = float("nan")
    got = stack_pixels(reqs, torch.device("cpu"), dtype, staged=staged)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_canvas_rules():
    arr = supported_aspect_ratios(4)
    assert arr == ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))
    assert optimal_canvas(50, 100, 56, arr) == (56, 112)
    assert fit_to_canvas(50, 100, 56, 112, 56) == (50, 100)  # no upscaling to fill the canvas
    assert optimal_canvas(2000, 2000, 560, arr) == (1120, 1120)


def test_sources_file_bytes_data_url(tmp_path):
    img = synthetic_image(80, 60)
    data = _png(img)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    cfg = MllamaImageConfig(image_size=56)
    ref = preprocess_images([img], cfg).pixel_values
    for src in (str(path), path, data, url):
        assert torch.equal(preprocess_images([src], cfg).pixel_values, ref)


@pytest.mark.parametrize("src,msg", [
    ("https://example.com/cat.png", "remote image URLs are refused"),
    ("http://example.com/cat.png", "remote image URLs are refused"),
    (b"not an image", "cannot decode image"),
    ("data:image/png;base64,aGVsbG8=", "cannot decode image"),
    ("data:image/png,rawdata", "base64"),
    ("/nonexistent/x.png", "not found"),
    ("ftp://host/x.png", "unsupported image URL scheme"),
])
def test_bad_sources(src, msg):
    with pytest.raises(ImageInputError, match=msg):
        load_image(src)


def test_too_many_images():
    cfg = MllamaImageConfig(image_size=56, max_images=2)
    with pytest.raises(ImageInputError, match="too many images"):
        preprocess_images([synthetic_image(60, 60)] * 3, cfg)
    assert preprocess_images([], cfg) is None
