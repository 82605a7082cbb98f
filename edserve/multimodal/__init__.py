"""Multimodal inputs: image loading, preprocessing and prompt/cross-attention layout."""

from edserve.multimodal.errors import ImageInputError

__all__ = ["ImageInputError"]
