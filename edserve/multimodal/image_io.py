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


#: Largest accepted image, in pixels (width x height), checked from the header before any
#: pixel is decoded. Mllama resizes to at most 4 tiles of 560 px, so 40 MP is generous.
#: (Pillow's own decompression-bomb guard, ``Image.MAX_IMAGE_PIXELS``, stays on as well.)
MAX_IMAGE_PIXELS = 40_000_000


def _decode_bytes(data: bytes, what: str) -> Image.Image:
    """Open, check the declared size, then decode. Error texts are fixed phrases (no reprs,
    no addresses)."""
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageInputError(f"image ({what}) is too large: the limit is "
                              f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageInputError(f"cannot decode image ({what}): not a supported image "
                              "format") from None
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        img.close()
        raise ImageInputError(f"image ({what}) is {width}x{height} pixels; the limit is "
                              f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels")
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
        raise ImageInputError(f"cannot decode image ({what}): corrupt or truncated image "
                              "data") from None
    return img


def _decode_data_url(url: str) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageInputError("malformed data: URL (no ',' separating header and payload)")
    if not header.endswith(";base64"):
        raise ImageInputError("only base64-encoded data: URLs are supported for images")
    try:
        data = base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise ImageInputError("invalid base64 in the data: URL") from None
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
