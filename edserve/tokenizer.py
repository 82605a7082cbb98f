"""Whisper's tokenizer: byte-level BPE from a ``tokenizer.json`` plus Whisper's special tokens.

The vocabulary is laid out as openai-whisper's::

    [0, eot)                      text tokens (GPT-2 BPE; multilingual models have one more)
    eot                           <|endoftext|>        (50256 English-only, 50257 multilingual)
    sot = eot + 1                 <|startoftranscript|>
    sot + 1 ...                   <|en|>, <|zh|>, ... language tokens
    ...                           <|translate|> <|transcribe|> <|startoflm|> <|startofprev|>
                                  <|nocaptions|> or <|nospeech|>, <|notimestamps|>
    timestamp_begin ...           <|0.00|> ... <|30.00|>  (1501 tokens, one per 20 ms)

Many ``tokenizer.json`` files (CTranslate2's among them) stop before the timestamp tokens;
:meth:`WhisperTokenizer.from_file` appends them right after the last special token.
Following openai-whisper, a model is multilingual when its vocabulary holds 51865 or more
tokens (English-only models have 51864).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer

from edserve.token_bytes import token_bytes

NUM_TIMESTAMP_TOKENS = 1501  # <|0.00|> .. <|30.00|>
TIMESTAMP_TOKENS_PER_SECOND = 50  # one timestamp token per 20 ms
MULTILINGUAL_MIN_VOCAB = 51865
TASKS = ("transcribe", "translate")

_LANGUAGE_TOKEN = re.compile(r"<\|([a-z]{2,3})\|>")
_REQUIRED = {
    "eot": "<|endoftext|>",
    "sot": "<|startoftranscript|>",
    "translate": "<|translate|>",
    "transcribe": "<|transcribe|>",
    "sot_lm": "<|startoflm|>",
    "sot_prev": "<|startofprev|>",
    "no_timestamps": "<|notimestamps|>",
}
_NO_SPEECH = ("<|nocaptions|>", "<|nospeech|>")


def _timestamp_text(index: int) -> str:
    return f"<|{index / TIMESTAMP_TOKENS_PER_SECOND:.2f}|>"


class WhisperTokenizer:
    """Text <-> token ids for Whisper models, and the ids of Whisper's special tokens.

    Build one with :meth:`from_file`. Ids are plain ``int``; every lookup is O(1).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, name: str = "") -> None:
        self._tok = tokenizer
        self._name = name or "tokenizer"
        specials = {
            tok.content: idx
            for idx, tok in tokenizer.get_added_tokens_decoder().items()
            if tok.special
        }
        missing = [text for text in _REQUIRED.values() if text not in specials]
        no_speech = [specials[t] for t in _NO_SPEECH if t in specials]
        if missing or not no_speech:
            missing += [] if no_speech else [" or ".join(_NO_SPEECH)]
            raise ValueError(f"{self._name} is not a Whisper tokenizer: lacks {', '.join(missing)}")
        self._ids = {key: specials[text] for key, text in _REQUIRED.items()}
        self._ids["no_speech"] = no_speech[0]
        self._languages = {
            m.group(1): idx
            for text, idx in sorted(specials.items(), key=lambda kv: kv[1])
            if (m := _LANGUAGE_TOKEN.fullmatch(text))
        }
        self._timestamp_begin = self._ensure_timestamps(max(specials.values()))
        n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and vocab_size < n_vocab:
            raise ValueError(
                f"{self._name} holds {n_vocab} tokens (with timestamps) but the model's "
                f"vocab_size is {vocab_size}"
            )
        self._vocab_size = n_vocab if vocab_size is None else vocab_size

    @classmethod
    def from_file(cls, path: str | os.PathLike, vocab_size: int | None = None) -> WhisperTokenizer:
        """Load a ``tokenizer.json``; ``vocab_size`` is the model's (embedding rows), if known.

        Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file that is
        not a Whisper tokenizer or does not fit ``vocab_size``.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path!r} not found")
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"cannot parse tokenizer file {path!r}: {e}") from e
        return cls(tokenizer, vocab_size, name=repr(path))

    def _ensure_timestamps(self, last_special: int) -> int:
        """Return the id of ``<|0.00|>``, appending all timestamp tokens if they are absent."""
        first = self._tok.token_to_id(_timestamp_text(0))
        if first is None:
            first = self._tok.get_vocab_size(with_added_tokens=True)
            if first != last_special + 1:
                raise ValueError(
                    f"{self._name}: cannot append timestamp tokens after the last special token "
                    f"({last_special}); the vocabulary already runs to {first - 1}"
                )
            self._tok.add_special_tokens(
                [
                    AddedToken(_timestamp_text(i), special=True, normalized=False)
                    for i in range(NUM_TIMESTAMP_TOKENS)
                ]
            )
        last = self._tok.token_to_id(_timestamp_text(NUM_TIMESTAMP_TOKENS - 1))
        if last != first + NUM_TIMESTAMP_TOKENS - 1:
            raise ValueError(f"{self._name}: timestamp tokens are not contiguous")
        return first

    # ---- special token ids -----------------------------------------------------------------
    @property
    def eot(self) -> int:
        return self._ids["eot"]

    @property
    def sot(self) -> int:
        return self._ids["sot"]

    @property
    def transcribe(self) -> int:
        return self._ids["transcribe"]

    @property
    def translate(self) -> int:
        return self._ids["translate"]

    @property
    def sot_prev(self) -> int:
        return self._ids["sot_prev"]

    @property
    def sot_lm(self) -> int:
        return self._ids["sot_lm"]

    @property
    def no_speech(self) -> int:
        return self._ids["no_speech"]

    @property
    def no_timestamps(self) -> int:
        return self._ids["no_timestamps"]

    @property
    def timestamp_begin(self) -> int:
        return self._timestamp_begin

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (given to :meth:`from_file`, else the tokenizer's)."""
        return self._vocab_size

    @property
    def is_multilingual(self) -> bool:
        return bool(self._languages) and self._vocab_size >= MULTILINGUAL_MIN_VOCAB

    @property
    def all_language_codes(self) -> tuple[str, ...]:
        """Language codes with a token in the vocabulary, in id order ("en" first)."""
        return tuple(self._languages)

    def language_token(self, code: str) -> int:
        """The id of ``<|code|>``; ``ValueError`` for a code without a token."""
        try:
            return self._languages[code]
        except KeyError:
            raise ValueError(f"unknown language code {code!r}") from None

    def language_code(self, token: int) -> str:
        """The id of ``<|code|>`` -> ``code``; ``ValueError`` for any other token."""
        for code, idx in self._languages.items():
            if idx == token:
                return code
        raise ValueError(f"token {token} is not a language token")

    def sot_sequence(
        self, language: str | None, task: str = "transcribe", timestamps: bool = False
    ) -> list[int]:
        """The decoder prompt: ``[sot, lang, task]`` (multilingual) or ``[sot]`` (English-only).

        ``<|notimestamps|>`` is appended when ``timestamps`` is False. English-only models accept
        only ``language`` None or "en" and task "transcribe"; a multilingual model given no
        language gets ``[sot, task]``: the long-form driver then decodes ``[sot]`` and has the
        model choose the language token first (:mod:`edserve.whisper.language`).
        """
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        if self.is_multilingual:
            seq = [self.sot]
            if language is not None:
                seq.append(self.language_token(language))
            seq.append(self.transcribe if task == "transcribe" else self.translate)
        else:
            if language not in (None, "en"):
                raise ValueError(f"English-only model cannot take language {language!r}")
            if task != "transcribe":
                raise ValueError(f"English-only model cannot {task}")
            seq = [self.sot]
        if not timestamps:
            seq.append(self.no_timestamps)
        return seq

    # ---- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text -> ids, without any special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; special and timestamp tokens are skipped."""
        eot = self.eot
        return self._tok.decode([t for t in map(int, ids) if t < eot], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """A text token's own bytes (:func:`edserve.token_bytes.token_bytes`): a token
        sequence's concatenate to ``decode(tokens).encode()``."""
        return token_bytes(self._tok, token)

    def decode_with_timestamps(self, ids: Iterable[int]) -> str:
        """Like :meth:`decode` but renders timestamp tokens as ``<|1.08|>``."""
        parts: list[str] = []
        text: list[int] = []
        for t in map(int, ids):
            if t < self.eot:
                text.append(t)
            elif t >= self._timestamp_begin:
                parts.append(self._tok.decode(text, skip_special_tokens=False))
                parts.append(_timestamp_text(t - self._timestamp_begin))
                text = []
        parts.append(self._tok.decode(text, skip_special_tokens=False))
        return "".join(parts)

    def is_timestamp(self, token: int) -> bool:
        return self._timestamp_begin <= token < self._timestamp_begin + NUM_TIMESTAMP_TOKENS

    def timestamp_to_seconds(self, token: int) -> float:
        """``<|1.08|>``'s id -> 1.08; ``ValueError`` for a non-timestamp token."""
        if not self.is_timestamp(token):
            raise ValueError(f"token {token} is not a timestamp token")
        return (token - self._timestamp_begin) / TIMESTAMP_TOKENS_PER_SECOND

    def blank_tokens(self) -> tuple[int, ...]:
        """``encode(" ")`` (what ``SuppressBlank`` forbids first), encoded once per tokenizer."""
        cached = self.__dict__.get("_blank")
        if cached is None:
            cached = self._blank = tuple(self.encode(" "))
        return cached

    def non_speech_tokens(self) -> tuple[int, ...]:
        """openai-whisper's ``non_speech_tokens``: symbols and speaker tags worth suppressing.

        Tokens for lone symbols such as ``"#"`` or ``" ["`` (but not ``"-"`` / ``"'"`` inside
        words) and musical notes; sorted ids.
        """
        cached = self.__dict__.get("_non_speech")
        if cached is not None:  # encoded once per tokenizer (~2 ms), not once per task
            return cached
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")  # may be split into several byte tokens: keep the first
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        self._non_speech: tuple[int, ...] = tuple(sorted(result))
        return self._non_speech
