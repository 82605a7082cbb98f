"""Client-facing validation of chat inputs: image pixel caps before decoding, error texts
without reprs/heap addresses, ``stop`` and ``role`` type checks."""

from __future__ import annotations

import base64
import re
import struct
import time
import zlib

import pytest

from edserve.chat.chat_api import normalize_stop
from edserve.chat.mllama_chat import ChatFormatError, render_chat
from edserve.multimodal import ImageInputError
from edserve.multimodal.image_io import MAX_IMAGE_PIXELS, load_image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data \
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def huge_png(side: int = 13000) -> bytes:
    """A valid, all-black 1-bit ``side`` x ``side`` PNG (a few hundred KB)."""
    comp = zlib.compressobj(9)
    row = b"\0" * (1 + (side + 7) // 8)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) \
        + _chunk(b"IEND", b"")


def huge_png_url() -> str:
    return "data:image/png;base64," + base64.b64encode(huge_png()).decode()


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_huge_image_refused_by_declared_size_before_decoding():
    data = huge_png()
    assert len(data) < 1_000_000 and 13000 * 13000 > MAX_IMAGE_PIXELS
    start = time.perf_counter()
    with pytest.raises(ImageInputError, match="13000x13000 pixels; the limit is 40 megapixels"):
        load_image(data)
    assert time.perf_counter() - start < 0.5  # header only: decoding would take seconds


@pytest.mark.parametrize("src", [b"not an image", "data:image/png;base64,aGVsbG8=",
                                 huge_png(64)[:50], "data:image/png;base64,!!!"])
def test_image_errors_have_no_reprs_or_addresses(src):
    with pytest.raises(ImageInputError) as info:
        load_image(src)
    text = str(info.value)
    assert not re.search(r"0x[0-9a-f]{6,}|<_io|object at", text), text


@pytest.mark.parametrize("stop", [5, 1.5, {"a": 1}, True, [1, 2], [""], ["x"] * 17])
def test_stop_types_refused(stop):
    with pytest.raises(ValueError, match="'stop'"):
        normalize_stop(stop)
    assert normalize_stop(["a", "a", "b"]) == ("a", "b") and normalize_stop("x") == ("x",)


@pytest.mark.parametrize("role", [["user"], {"x": 1}, 5, None, "x" * 1000])
def test_bad_roles_are_format_errors(role):
    with pytest.raises(ChatFormatError, match="role must be one of") as info:
        render_chat([{"role": role, "content": "hi"}])
    assert len(str(info.value)) < 200
