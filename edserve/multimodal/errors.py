"""Errors raised for bad multimodal inputs (surfaced to API callers as 4xx)."""

from __future__ import annotations


class ImageInputError(ValueError):
    """An image input cannot be used: refused URL, undecodable data, too many images, or an
    ``<|image|>`` token count that does not match the images. The message is user-facing."""
