"""``timestamp_granularities[]=word`` through the official ``openai`` client (tiny.en server):
verbose_json carries OpenAI's ``words`` ``[{word, start, end}]``; with ``segment`` too, both."""

from __future__ import annotations

from .server_helpers import DATA, integrity


def _create(client, granularities):
    with open(DATA / "jfk.wav", "rb") as f:
        return client.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json",
            timestamp_granularities=granularities)


def test_word_granularity_returns_words(client, http):
    result = _create(client, ["word"])
    words = result.words
    assert words and " ".join(w.word for w in words).startswith("And so my fellow Americans")
    assert all(w.word == w.word.strip() and 0 <= w.start <= w.end <= 11.01 for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert words[-1].word == "country." and result.text.endswith("country.")
    both = _create(client, ["word", "segment"])
    assert both.segments and [w.word for w in both.words] == [w.word for w in words]
    assert both.segments[-1].end == words[-1].end  # segment times follow the words
    integrity(http)  # every row freed, the pool intact


def test_segment_granularity_has_no_words(client):
    assert getattr(_create(client, ["segment"]), "words", None) is None
