"""``token_bytes``: a token's own bytes, by kind of tokenizer (Whisper's own tokens:
``tests/test_tokenizer.py``)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE, WordLevel

from edserve.chat.mllama_chat import ChatTokenizer
from edserve.token_bytes import BYTE_OF, token_bytes


def test_token_bytes_by_kind_of_tokenizer():
    """Byte-level BPE: a lone byte of a two-byte character is that byte (its decoded text is
    U+FFFD); any other tokenizer: the token's text as UTF-8, even where its characters happen
    to be in the byte-level alphabet ('é' would otherwise read as the byte 0xE9)."""
    byte_level = Tokenizer(BPE({"Ã": 0, "©": 1, "a": 2}, []))  # bytes 0xC3, 0xA9 ('é'), 'a'
    byte_level.decoder = decoders.ByteLevel()
    assert byte_level.decode([0]) == "\ufffd"
    assert [token_bytes(byte_level, t) for t in (0, 1, 2)] == [b"\xc3", b"\xa9", b"a"]
    assert b"".join(token_bytes(byte_level, t) for t in (2, 0, 1)).decode() == "aé"
    words = Tokenizer(WordLevel({"café": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert token_bytes(words, 0) == "café".encode()
    chat = ChatTokenizer.__new__(ChatTokenizer)  # only its tokenizer matters here
    chat.tokenizer = byte_level
    assert chat.token_bytes(0) == b"\xc3"


def test_the_byte_alphabet_spells_every_byte_once():
    """256 characters, one per byte; printable ASCII (but the space) stands for itself."""
    assert sorted(BYTE_OF.values()) == list(range(256))
    assert all(BYTE_OF[chr(b)] == b for b in range(ord("!"), ord("~") + 1))
