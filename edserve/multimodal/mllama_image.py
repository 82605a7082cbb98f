"""Mllama image preprocessing (Pillow + torch; matches HF ``MllamaImageProcessorPil`` exactly).

Per image: choose the best tile arrangement (canvas), resize to fit it without upscaling past
the rules of :func:`fit_to_canvas`, pad bottom/right with 0 (before normalisation, so padding
becomes ``-mean/std``), rescale by 1/255, normalise with the CLIP mean/std, split into tiles
row-major, and pad the tile axis to ``max_image_tiles`` with exact-zero tiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from edserve.multimodal.errors import ImageInputError
from edserve.multimodal.image_io import ImageSource, load_image, to_rgb

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@lru_cache(maxsize=16)
def supported_aspect_ratios(max_image_tiles: int) -> tuple[tuple[int, int], ...]:
    """Tile arrangements ``(rows, cols)`` with ``rows * cols <= max_image_tiles``, in HF's
    order; the aspect-ratio id of an arrangement is its index + 1 (0 = no image)."""
    return tuple((a, b) for a in range(1, max_image_tiles + 1)
                 for b in range(1, max_image_tiles + 1) if a * b <= max_image_tiles)


@dataclass(frozen=True)
class MllamaImageConfig:
    """Preprocessing settings (HF ``preprocessor_config.json`` for the 11B model by default)."""

    image_size: int = 560  # tile side S
    max_image_tiles: int = 4  # T
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    max_images: int = 4  # per request; more -> ImageInputError
    aspect_ratios: tuple[tuple[int, int], ...] = field(default=())  # () = the default list

    @property
    def arrangements(self) -> tuple[tuple[int, int], ...]:
        return self.aspect_ratios or supported_aspect_ratios(self.max_image_tiles)

    @classmethod
    def from_hf(cls, preprocessor: dict | None = None, **overrides) -> MllamaImageConfig:
        """From an HF ``preprocessor_config.json`` dict (missing keys keep the 11B defaults)."""
        p = preprocessor or {}
        kw: dict = {}
        if "size" in p:
            kw["image_size"] = int(p["size"]["height"])
        if "max_image_tiles" in p:
            kw["max_image_tiles"] = int(p["max_image_tiles"])
        if "image_mean" in p:
            kw["image_mean"] = tuple(float(x) for x in p["image_mean"])
        if "image_std" in p:
            kw["image_std"] = tuple(float(x) for x in p["image_std"])
        if "rescale_factor" in p:
            kw["rescale_factor"] = float(p["rescale_factor"])
        kw.update(overrides)
        return cls(**kw)


@dataclass(frozen=True)
class MllamaImageInput:
    """The preprocessed images of one request (what ``MllamaModel.encode`` consumes)."""

    pixel_values: torch.Tensor  # [N_img, T, 3, S, S] float32; padding tiles are exact zeros
    aspect_ratio_ids: torch.Tensor  # [N_img] int64, 1-based index into the arrangements
    aspect_ratio_mask: torch.Tensor  # [N_img, T] int64, 1 for valid tiles
    num_tiles: tuple[int, ...]  # valid tiles per image

    @property
    def num_images(self) -> int:
        return len(self.num_tiles)


def stack_pixels(images: Sequence[MllamaImageInput], device: torch.device,
                 dtype: torch.dtype, staged: bool | None = None) -> torch.Tensor:
    """The ``pixel_values`` of ``images`` stacked, ``[sum N_img, T, 3, S, S]`` on ``device`` in
    ``dtype``, reading only valid tiles: padding tiles are exact zeros by this module's
    contract, so they are zero-filled where they land instead of copied (64 requests of 1-4
    tiles send 160 of their 256 tile slots). On another device each image's valid tiles go
    from its own tensor into one staging buffer there, in the host dtype, and are cast there:
    no host concatenation or host cast (for 64 four-slot images that was ~1 GB of host
    memory written, then ~1 GB converted, before the vision tower could start). ``staged``
    forces (True) or skips (False) the staging buffer; None: staged when the devices differ."""
    first = images[0].pixel_values
    T, C, S = first.shape[1], first.shape[2], first.shape[3]
    out = torch.zeros((sum(x.num_images for x in images), T, C, S, S), device=device,
                      dtype=dtype)
    if staged is None:
        staged = first.device != out.device
    valid = sum(sum(x.num_tiles) for x in images)
    stage = torch.empty((valid, C, S, S), device=device, dtype=first.dtype) if staged else None
    i = k = 0
    for x in images:
        for j, t in enumerate(x.num_tiles):
            src = x.pixel_values[j, :t]  # [t, 3, S, S]
            if stage is not None:
                src = stage[k:k + t].copy_(src)
            out[i, :t].copy_(src)
            i, k = i + 1, k + t
    return out


def optimal_canvas(height: int, width: int, tile: int,
                   arrangements: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Best canvas ``(H, W)``: the smallest upscale >= 1, else the largest downscale; ties go to
    the smallest area, then to the first arrangement."""
    scales = [min(r * tile / height, c * tile / width) for r, c in arrangements]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    best = None
    for (r, c), s in zip(arrangements, scales, strict=True):
        if s == chosen and (best is None or r * c < best[0] * best[1]):
            best = (r, c)
    return best[0] * tile, best[1] * tile


def fit_to_canvas(height: int, width: int, canvas_h: int, canvas_w: int,
                  tile: int) -> tuple[int, int]:
    """Resized ``(h, w)``: each side clipped to ``[tile, canvas side]``, aspect ratio kept."""
    target_w = min(max(width, tile), canvas_w)
    target_h = min(max(height, tile), canvas_h)
    scale_h = target_h / height
    scale_w = target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


def image_to_tiles(img: Image.Image, cfg: MllamaImageConfig) -> tuple[torch.Tensor, int]:
    """One RGB image -> (tiles ``[T, 3, S, S]`` zero-padded to T, aspect-ratio id)."""
    S, arr = cfg.image_size, cfg.arrangements
    w, h = img.size
    canvas_h, canvas_w = optimal_canvas(h, w, S, arr)
    new_h, new_w = fit_to_canvas(h, w, canvas_h, canvas_w, S)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), resample=Image.BILINEAR)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    canvas = torch.zeros(3, canvas_h, canvas_w, dtype=torch.uint8)  # pad bottom/right with 0
    canvas[:, :new_h, :new_w] = pixels
    # Same arithmetic as HF: float64 rescale, float32 normalise.
    x = (canvas.double() * cfg.rescale_factor).float()
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.image_std, dtype=torch.float32)[:, None, None]
    x = (x - mean) / std
    rows, cols = canvas_h // S, canvas_w // S
    tiles = x.reshape(3, rows, S, cols, S).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, S, S)
    out = torch.zeros(cfg.max_image_tiles, 3, S, S, dtype=torch.float32)
    out[: rows * cols] = tiles
    return out, arr.index((rows, cols)) + 1


def preprocess_images(images: Sequence[ImageSource],
                      cfg: MllamaImageConfig) -> MllamaImageInput | None:
    """Load and preprocess one request's images; None when there are none (text-only).

    Raises :class:`ImageInputError` for refused URLs, undecodable data, or more than
    ``cfg.max_images`` images.
    """
    if len(images) == 0:
        return None
    if len(images) > cfg.max_images:
        raise ImageInputError(
            f"too many images: {len(images)} given, at most {cfg.max_images} per request")
    tiles, ids, counts = [], [], []
    for src in images:
        img = to_rgb(load_image(src))
        if img.width < 1 or img.height < 1:
            raise ImageInputError("empty image (zero width or height)")
        t, ar_id = image_to_tiles(img, cfg)
        tiles.append(t)
        ids.append(ar_id)
        rows, cols = cfg.arrangements[ar_id - 1]
        counts.append(rows * cols)
    T = cfg.max_image_tiles
    mask = torch.zeros(len(images), T, dtype=torch.int64)
    for i, n in enumerate(counts):
        mask[i, :n] = 1
    return MllamaImageInput(
        pixel_values=torch.stack(tiles),
        aspect_ratio_ids=torch.tensor(ids, dtype=torch.int64),
        aspect_ratio_mask=mask,
        num_tiles=tuple(counts),
    )
