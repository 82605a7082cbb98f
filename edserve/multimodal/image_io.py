"""Decode user-supplied images into RGB PIL images.

Accepted sources: a ``PIL.Image.Image``, raw ``bytes``, a filesystem path (``str`` or
``os.PathLike``), or a ``data:`` URL (``data:image/png;base64,...``). ``http(s)://`` URLs are
refused: edserve never fetches from the network.
"""

from __future__ import annotations

import base64
import binascii
import io
import os

from PIL import Image, UnidentifiedImageError

from edserve.multimodal.errors import ImageInputError

ImageSource = Image.Image | bytes | bytearray | str | os.PathLike


def _decode_bytes(data: bytes, what: str) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageInputError(f"cannot decode image ({what}): {e}") from e
    return img


def _decode_data_url(url: str) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageInputError("malformed data: URL (no ',' separating header and payload)")
    if not header.endswith(";base64"):
        raise ImageInputError("only base64-encoded data: URLs are supported for images")
    try:
        data = base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"invalid base64 in data: URL: {e}") from e
    return _decode_bytes(data, "data: URL")


def load_image(src: ImageSource) -> Image.Image:
    """Return ``src`` as a decoded PIL image (mode unchanged; see :func:`to_rgb`)."""
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, (bytes, bytearray)):
        return _decode_bytes(bytes(src), "bytes")
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    if not isinstance(src, str):
        raise ImageInputError(f"unsupported image input type {type(src).__name__}")
    low = src[:16].lower()
    if low.startswith(("http://", "https://")):
        raise ImageInputError(
            "remote image URLs are refused (edserve has no network access); send the image "
            "inline as a data: URL (data:image/png;base64,...)")
    if low.startswith("data:"):
        return _decode_data_url(src)
    if "://" in src[:16]:
        raise ImageInputError(f"unsupported image URL scheme: {src.split('://', 1)[0]}://")
    if not os.path.isfile(src):
        raise ImageInputError(f"image file not found: {src}")
    with open(src, "rb") as f:
        return _decode_bytes(f.read(), src)


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB conversion as HF does it: transparency is composited onto a white background."""
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")
