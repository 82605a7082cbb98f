"""The tiny random Mllama saved with a made-up chat tokenizer (Llama-3 special tokens as added
tokens, a WordLevel vocabulary of words over the tiny model's 128 ids), for the chat tests."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny, synthetic_image

SPECIAL = {"<|pad|>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2,
           "<|start_header_id|>": 3, "<|end_header_id|>": 4, "<|eot_id|>": 5,
           "<|python_tag|>": 6, "<|eom_id|>": 7, "<|image|>": 128}
WORDS = ["user", "assistant", "system", "Cutting", "Knowledge", "Date:", "December", "2023",
         "Today", "26", "Jul", "2024", "describe", "the", "image", "what", "is", "this",
         "hello", "world", "a", "cat", "dog", "red"]
STOP_IDS = (2, 7, 5)  # <|end_of_text|>, <|eom_id|>, <|eot_id|> (the tiny config's eos is 2)


def chat_vocab(vocab_size: int = 128) -> dict[str, int]:
    """Every id below ``vocab_size`` named (specials, WORDS, then ``w<id>``); ``<|image|>`` is
    ``vocab_size`` (the model's ``image_token_index``)."""
    vocab = dict(SPECIAL, **{"<|image|>": vocab_size})
    for i, w in enumerate(WORDS):
        vocab[w] = 8 + i
    for i in range(8 + len(WORDS), vocab_size):
        vocab[f"w{i}"] = i
    return vocab


def save_chat_tokenizer(folder: Path, vocab_size: int = 128) -> Path:
    """``tokenizer.json``: WordLevel + whitespace split; special tokens split out and skipped
    when decoding; decoded words are joined by single spaces. ``vocab_size``: the model's
    (the benchmarks save larger random models with it)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = chat_vocab(vocab_size)
    tok = Tokenizer(WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in sorted(SPECIAL, key=vocab.get)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies spell):
    :data:`edserve.token_bytes.BYTE_OF`, inverted."""
    from edserve.token_bytes import BYTE_OF

    return {b: c for c, b in BYTE_OF.items()}


BYTE_MERGES = ('{"', '":', '",', '"}')  # multi-character tokens the JSON tests cross


def save_byte_chat_tokenizer(folder: Path, vocab_size: int = 128) -> Path:
    """A byte-level BPE ``tokenizer.json`` (as Llama 3's, in miniature): the specials, one
    token per printable ASCII character and newline, :data:`BYTE_MERGES`, then filler tokens;
    any ASCII text round-trips, so grammar-constrained output (JSON) can be spelled."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    chars = _byte_chars()
    vocab = {t: i for t, i in SPECIAL.items() if t != "<|image|>"}
    for b in [*range(32, 127), 10]:
        vocab[chars[b]] = len(vocab)
    merges = [(chars[ord(m[0])], chars[ord(m[1])]) for m in BYTE_MERGES]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<|filler_{len(vocab)}|>"] = len(vocab)
    vocab["<|image|>"] = vocab_size
    tok = Tokenizer(BPE(vocab, merges))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in sorted(SPECIAL, key=vocab.get)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def save_chat_model(folder: Path) -> Path:
    """The facts' tiny model (gates randomised) + the chat tokenizer, as an HF folder."""
    save_hf_tiny(build_hf_tiny(), folder)
    return save_chat_tokenizer(folder)


def png_data_url(width: int, height: int, seed: int = 0) -> str:
    buf = io.BytesIO()
    synthetic_image(width, height, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
