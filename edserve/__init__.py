"""edserve: a serving engine for encoder-decoder models with a paged KV cache."""

__version__ = "0.1.0"
