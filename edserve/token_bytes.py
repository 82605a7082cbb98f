"""A token's own bytes, for OpenAI's ``logprobs[].bytes``, from any ``tokenizers.Tokenizer``.

Byte-level BPE vocabularies (GPT-2's scheme: Whisper's, Llama 3's) spell every byte as one
printable character: printable Latin-1 as itself, every other byte as a character from U+0100
on. :data:`BYTE_OF` maps each of those 256 characters back to its byte.

:func:`token_bytes` gives, for a tokenizer whose decoder is ``ByteLevel``, the raw bytes of a
token's vocabulary entry, so that:

- a piece of a multi-byte UTF-8 character is that piece (``decode([token])`` shows U+FFFD);
- the bytes of a token sequence concatenate to the UTF-8 of its decoded text.

Special tokens, entries with a character outside the byte alphabet, and tokenizers of any
other kind give the token decoded alone, as UTF-8.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE
    vocabulary (printable Latin-1 as itself, the rest from U+0100 on), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(extra)})
    return chars


BYTE_OF = _byte_level_chars()


def token_bytes(tok: Tokenizer, token: int) -> bytes:
    """A token's own bytes (OpenAI's ``logprobs[].bytes``). For a byte-level BPE tokenizer
    (its decoder is ``ByteLevel``: Whisper's, Llama 3's) the raw bytes of its vocabulary entry,
    so a piece of a multi-byte UTF-8 character is that piece (not U+FFFD, as ``decode([token])``
    shows it) and a sequence's bytes concatenate to its decoded text's UTF-8; special tokens,
    entries outside the byte alphabet and other tokenizers: the token decoded alone, as UTF-8."""
    piece = tok.id_to_token(int(token)) or ""
    if isinstance(tok.decoder, decoders.ByteLevel) and piece \
            and all(c in BYTE_OF for c in piece):
        return bytes(BYTE_OF[c] for c in piece)
    return tok.decode([int(token)], skip_special_tokens=False).encode("utf-8")
