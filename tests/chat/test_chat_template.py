"""Llama-3.2-Vision chat layer: template text, message parsing, tokenizer wrapper, incremental
detokenizing with stop strings, and the Python ``chat`` API on the tiny random Mllama."""

from __future__ import annotations

import pytest

from edserve.chat.chat_api import ChatDecoder, chat, normalize_stop, prepare_chat
from edserve.chat.mllama_chat import (
    ChatFormatError,
    ChatTokenizer,
    chat_prompt_ids,
    render_chat,
)
from edserve.chat.mllama_request import make_mllama_request
from edserve.engine.request import SamplingParams
from edserve.multimodal import ImageInputError

H = "<|start_header_id|>{}<|end_header_id|>\n\n"
SYS = H.format("system") + "Cutting Knowledge Date: December 2023\nToday Date: {}\n\n{}<|eot_id|>"
GEN = H.format("assistant")


def _img_part(url: str = "data:image/png;base64,xx") -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_prompt_has_no_system_block():
    msgs = [{"role": "user", "content": [_img_part(), {"type": "text", "text": "What is it?"}]}]
    p = render_chat(msgs)
    assert p.text == "<|begin_of_text|>" + H.format("user") + "<|image|>What is it?<|eot_id|>" \
        + GEN
    assert p.images == ["data:image/png;base64,xx"]


def test_text_prompt_gets_system_block_and_history():
    msgs = [{"role": "developer", "content": "  Be brief. "},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": " b"}]}]
    p = render_chat(msgs, date_string="01 Jan 2025")
    assert p.text == ("<|begin_of_text|>" + SYS.format("01 Jan 2025", "Be brief.")
                      + H.format("user") + "hi<|eot_id|>" + H.format("assistant")
                      + "hello<|eot_id|>" + H.format("user") + "a b<|eot_id|>" + GEN)
    assert render_chat([{"role": "user", "content": "x"}]).text == (
        "<|begin_of_text|>" + SYS.format("26 Jul 2024", "") + H.format("user") + "x<|eot_id|>"
        + GEN)


@pytest.mark.parametrize("messages,match", [
    ([{"role": "system", "content": "s"}, {"role": "user", "content": [_img_part()]}],
     "incompatible with system messages"),
    ([{"role": "user", "content": [_img_part()]}, {"role": "system", "content": "s"}],
     "incompatible with system messages"),
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "must be an object"),
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user", "content": 3}], "string or a list"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "unsupported content part"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "text must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "url must be"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        render_chat(messages)


def test_server_mode_refuses_local_images():
    with pytest.raises(ImageInputError, match="must be a data: URL"):
        render_chat([{"role": "user", "content": [_img_part("/etc/hostname")]}],
                    allow_local_images=False)
    with pytest.raises(ChatFormatError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image", "image": b"x"}]}],
                    allow_local_images=False)
    assert render_chat([{"role": "user", "content": [_img_part("/tmp/a.png")]}]).images == \
        ["/tmp/a.png"]


def test_normalize_stop():
    assert normalize_stop(None) == () and normalize_stop("x") == ("x",)
    assert normalize_stop(["a", "b", "a"]) == ("a", "b")
    for bad in ([""], ["a"] * 17, [1]):
        with pytest.raises(ValueError, match="'stop'"):
            normalize_stop(bad)


class _CharTokenizer:
    """Token id = one character (code point); 0xFFFD marks a 'partial' character."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _decode_all(stop, pieces):
    dec = ChatDecoder(_CharTokenizer(), stop)  # type: ignore[arg-type]
    out = [dec.push([ord(c) for c in p]) for p in pieces]
    out.append(dec.flush())
    return dec, out


def test_decoder_stop_string_across_tokens():
    dec, out = _decode_all(["END"], ["ab", "cE", "N", "D", "xyz"])
    assert dec.stopped and dec.text == "abc" and "".join(out) == "abc"
    assert out[1] == "c" and out[2] == ""  # "E", "EN" held back while they could start END
    assert len(dec.token_ids) == 6  # consumed up to the token completing the stop string
    dec, out = _decode_all(["END"], ["aE", "Nb"])
    assert not dec.stopped and out == ["a", "ENb", ""]


def test_decoder_holds_back_partial_characters():
    dec, out = _decode_all([], ["a\ufffd", "b"])
    assert out == ["a", "\ufffdb", ""] and dec.text == "a\ufffdb"


# ---- on the tiny model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("transformers")
    from edserve.runtime import build_engine
    from tests.models.mllama.chat_tiny import save_chat_model

    folder = save_chat_model(tmp_path_factory.mktemp("chat_tpl"))
    return build_engine(model=str(folder), device="cpu", dtype="float32", context_length=96,
                  max_running_requests=4)


def test_tokenizer_wrapper(engine):
    from tests.models.mllama.chat_tiny import STOP_IDS

    tok = ChatTokenizer.for_model(engine.model, engine.tokenizer)
    assert tok.stop_token_ids == STOP_IDS
    msgs = [{"role": "user", "content": [_img_part(), {"type": "text", "text": "describe"}]}]
    ids, images = chat_prompt_ids(tok, msgs)
    assert ids == [1, 3, 8, 4, 128, 20, 5, 3, 9, 4] and len(images) == 1
    assert tok.decode([1, 20, 21, 5, 22]) == "describe the image"
    with pytest.raises(ValueError, match="image token"):
        ChatTokenizer(engine.tokenizer, image_token_id=7)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    with pytest.raises(ValueError, match="special tokens"):
        ChatTokenizer(Tokenizer(WordLevel({"a": 0}, unk_token="a")))


def test_chat_matches_engine_tokens(engine):
    from tests.models.mllama.hf_tiny import synthetic_image

    img = synthetic_image(100, 50)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "what is this"}]}]
    res = chat(engine, msgs, max_tokens=10)
    req = make_mllama_request(engine.model, [1, 3, 8, 4, 128, 23, 24, 25, 5, 3, 9, 4], [img],
                              SamplingParams(max_new_tokens=10, stop_token_ids=(2, 7, 5)))
    ref = engine.generate([req])[0]
    assert res.token_ids == ref.token_ids and res.prompt_tokens == 12
    assert res.text == engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert res.finish_reason == "length" and res.completion_tokens == len(res.token_ids) == 10
    assert res.usage == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}
    words = res.text.split(" ")
    cut = chat(engine, msgs, max_tokens=10, stop=[words[3]])
    assert cut.finish_reason == "stop" and cut.text == res.text[:res.text.index(words[3])]
    assert cut.token_ids == res.token_ids[:words.index(words[3]) + 1]
    a = chat(engine, msgs, max_tokens=6, temperature=1.0, seed=3)
    assert a.token_ids == chat(engine, msgs, max_tokens=6, temperature=1.0, seed=3).token_ids
    engine.check_integrity()


def test_chat_bad_inputs(engine):
    user = lambda *parts: [{"role": "user", "content": list(parts)}]  # noqa: E731
    with pytest.raises(ImageInputError, match="too many images"):
        chat(engine, user(*[_img_part()] * 5))
    with pytest.raises(ImageInputError, match="cannot decode image"):
        chat(engine, user(_img_part("data:image/png;base64,aGVsbG8=")))
    with pytest.raises(ImageInputError, match="remote image URLs are refused"):
        chat(engine, user(_img_part("http://example.com/x.png")))
    with pytest.raises(ImageInputError, match="must match"):
        chat(engine, [{"role": "user", "content": "hi <|image|>"}])
    with pytest.raises(ValueError, match="temperature"):
        chat(engine, [{"role": "user", "content": "hi"}], temperature=3)
    with pytest.raises(ValueError, match="Mllama"):
        prepare_chat(object(), [{"role": "user", "content": "hi"}])
    engine.check_integrity()
