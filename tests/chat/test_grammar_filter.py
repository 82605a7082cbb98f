"""Grammar-constrained chat output on the tiny random Mllama with a byte-level tokenizer.

Oracle: llguidance's matcher run independently over the same tokens. Every chosen token must be
the argmax (greedy) of the unconstrained logits restricted to the tokens the grammar allowed
at that step (recorded before the grammar filter), every sampled token must be allowed, and a
finished output must parse as JSON valid against its schema."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from edserve.chat.chat_api import chat
from edserve.chat.grammar_filter import GrammarFilter
from edserve.chat.response_format import response_grammar
from edserve.engine.logits_filter import FilterContext
from edserve.engine.request import FinishReason, SamplingParams

pytest.importorskip("transformers")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tests.chat.grammar_helpers import (  # noqa: E402
    AS_SCHEMA,
    NO_WHITESPACE,
    SCHEMA,
    _allowed,
    _build,
    _messages,
    _oracle,
    _run,
    is_pet,
)
from tests.models.mllama.chat_tiny import (  # noqa: E402
    STOP_IDS,
    save_byte_chat_tokenizer,
    save_chat_model,
)
from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json_chat")
    save_hf_tiny(build_hf_tiny(), folder)
    return _build(save_byte_chat_tokenizer(folder))


def test_greedy_tokens_are_the_argmax_over_what_the_grammar_allows(engine):
    grammar = response_grammar(AS_SCHEMA)
    request, rec = _run(engine, _messages(), AS_SCHEMA, record=True, max_tokens=60,
                        logit_bias=NO_WHITESPACE)
    out = engine.generate([request])[0]
    assert out.finish_reason == FinishReason.STOP, "the schema is bounded: it must finish"
    assert len(rec.rows) == len(out.token_ids) + 1  # the last step chose a stop token
    oracle = _oracle(engine, grammar)
    for step, logits in enumerate(rec.rows):
        allowed = _allowed(oracle)[:logits.numel()]
        masked = logits.clone()
        masked[~torch.from_numpy(allowed)] = float("-inf")
        chosen = int(masked.argmax())
        if step == len(out.token_ids):
            assert chosen in STOP_IDS and oracle.is_accepting()
            break
        assert chosen == out.token_ids[step], f"step {step}"
        assert oracle.consume_token(chosen)
    text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert is_pet(json.loads(text)) and not is_pet({**json.loads(text), "n": -1})
    assert all(np.isfinite(out.logprobs))
    # the same through the Python chat API
    res = chat(engine, _messages(), max_tokens=60, logit_bias=NO_WHITESPACE,
               response_format=AS_SCHEMA)
    assert res.text == text and res.finish_reason == "stop"


def test_sampled_rows_stay_in_the_grammar_and_leave_other_rows_alone(engine, monkeypatch):
    grammar = response_grammar(AS_SCHEMA)
    calls: list[int] = []  # rows per apply_rows call: the batch's grammar rows go together
    batched = GrammarFilter.apply_rows.__func__
    monkeypatch.setattr(GrammarFilter, "apply_rows", classmethod(
        lambda cls, fs, logits, ctx: (calls.append(len(fs)), batched(cls, fs, logits, ctx))))
    free, _ = _run(engine, _messages("hello"), None, max_tokens=12)
    solo = engine.generate([free])[0].token_ids
    free, _ = _run(engine, _messages("hello"), None, max_tokens=12)
    rows = [_run(engine, _messages(seed=s), AS_SCHEMA, max_tokens=60, temperature=1.0, seed=s,
                 logit_bias=NO_WHITESPACE)[0] for s in range(4)]
    outs = engine.generate(rows + [free])
    assert outs[-1].token_ids == solo
    texts = set()
    for out in outs[:-1]:
        oracle = _oracle(engine, grammar)
        for token in out.token_ids:
            assert _allowed(oracle)[token] and oracle.consume_token(token)
        assert out.finish_reason == FinishReason.STOP and oracle.is_accepting()
        text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 1  # the seeds sample different values inside the schema
    assert calls[0] == 4 and max(calls) == 4  # one call a step (+1: the stop token)
    assert len(calls) <= max(len(o.token_ids) for o in outs) + 1


def test_filter_rolls_back_and_ends_a_row_that_left_the_grammar(engine):
    grammar = response_grammar(AS_SCHEMA)
    f = GrammarFilter(grammar, STOP_IDS)
    f.bind(engine.tokenizer, 1)
    ids = engine.tokenizer.encode('{"kind":"cat"', add_special_tokens=False).ids
    vocab = 128

    def step(tokens: list[int]) -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        hist = torch.tensor([tokens + [0] * (20 - len(tokens))])
        f.apply(logits, FilterContext(hist, torch.tensor([len(tokens)]), ("r",)))
        return torch.isfinite(logits[0])

    oracle = _oracle(engine, grammar)
    oracle.consume_tokens(ids)
    assert torch.equal(step(ids), torch.from_numpy(_allowed(oracle)[:vocab]))
    shorter = _oracle(engine, grammar)
    shorter.consume_tokens(ids[:2])
    assert torch.equal(step(ids[:2]), torch.from_numpy(_allowed(shorter)[:vocab]))  # rollback
    bad = engine.tokenizer.token_to_id("q")
    only_stops = step(ids[:2] + [bad])  # '{"k' then 'q': no key of the schema
    assert f.failed and sorted(torch.nonzero(only_stops)[:, 0].tolist()) == sorted(STOP_IDS)


def test_pickled_filter_carries_settings_only_and_refuses_groups(engine):
    f = GrammarFilter(response_grammar({"type": "json_object"}), STOP_IDS)
    f.bind(engine.tokenizer, 1)
    g = pickle.loads(pickle.dumps(f))
    assert g.grammar == f.grammar and g.stop_ids == STOP_IDS and g._matcher is None
    with pytest.raises(RuntimeError, match="before bind"):
        g.apply(torch.zeros(1, 128), FilterContext(torch.zeros(1, 4, dtype=torch.long),
                                                   torch.zeros(1, dtype=torch.long), ("r",)))
    with pytest.raises(ValueError, match="beam search or best_of"):
        g.bind(engine.tokenizer, 2)
    request, _ = _run(engine, _messages(), {"type": "json_object"}, max_tokens=4)
    request.sampling = SamplingParams(max_new_tokens=4, best_of=2, temperature=1.0,
                                      stop_token_ids=STOP_IDS)
    with pytest.raises(ValueError, match="best_of"):
        engine.make_req(request)
    with pytest.raises(ValueError, match="at least one stop token"):
        GrammarFilter(f.grammar, ())


def test_tokenizer_llguidance_cannot_read_is_refused_up_front(tmp_path):
    words = _build(save_chat_model(tmp_path))  # WordLevel, no byte-level decoder
    with pytest.raises(ValueError, match="cannot use this model's tokenizer"):
        chat(words, _messages("what is this"), max_tokens=8,
             response_format={"type": "json_object"})
    assert chat(words, _messages("what is this"), max_tokens=3).completion_tokens == 3


def test_bit_unpacking_paths_agree():
    from edserve.chat.grammar_filter import _banned, _unpack_numpy, _unpack_torch

    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    ref = torch.tensor([[bool(int(w) >> j & 1) for w in row for j in range(32)]
                        for row in words.tolist()])
    assert torch.equal(_unpack_numpy(words), ref) and torch.equal(_unpack_torch(words), ref)
    assert torch.equal(_banned(words, 150), ~ref[:, :150])
    wide = _banned(words, 170)  # tokens past the mask: never allowed
    assert torch.equal(wide[:, :160], ~ref) and bool(wide[:, 160:].all())


def test_compact_json_needs_no_whitespace_ban(engine):
    """--no-json-whitespace: the greedy random weights cannot pad (the same schema ran into
    whitespace without the logit_bias ban above)."""
    res = chat(engine, _messages(), max_tokens=60, response_format=AS_SCHEMA,
               json_whitespace=False)
    assert res.finish_reason == "stop"
    value = json.loads(res.text)
    jsonschema.validate(value, SCHEMA)
    assert res.text == json.dumps(value, separators=(",", ":"))  # nothing between tokens
    padded = chat(engine, _messages(), max_tokens=60, response_format=AS_SCHEMA)
    assert padded.finish_reason == "length" and not padded.text.startswith(res.text)


def test_warm_vocab_prepares_what_bind_uses(engine):
    from edserve.chat.grammar_filter import _grammar_vocab, warm_vocab

    _grammar_vocab.cache_clear()
    warm_vocab(engine).join(timeout=60)
    assert _grammar_vocab.cache_info().currsize == 1
    GrammarFilter(response_grammar({"type": "json_object"}), STOP_IDS).bind(engine.tokenizer, 1)
    assert _grammar_vocab.cache_info().hits == 1  # bind found the warmed vocabulary
    assert warm_vocab(object()) is None  # not a chat engine


def test_compiled_grammars_are_cached_and_each_request_starts_fresh(engine, monkeypatch):
    from edserve.chat import grammar_filter as gf

    grammar = response_grammar(AS_SCHEMA)
    others = [response_grammar({"type": "json_object"}), response_grammar(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})]
    monkeypatch.setattr(gf, "_COMPILED", type(gf._COMPILED)())
    monkeypatch.setattr(gf, "_COMPILED_MAX", 2)
    compiles = []

    def counting(vocab, text, **kw):
        compiles.append(text)
        return llguidance.LLMatcher(vocab, text, **kw)

    monkeypatch.setattr(gf, "llguidance", lambda: type("llg", (), {"LLMatcher": counting}))
    first, second = (GrammarFilter(grammar, STOP_IDS) for _ in range(2))
    first.bind(engine.tokenizer, 1)
    first._matcher.consume_tokens([engine.tokenizer.token_to_id(c) for c in '{"'])  # moved on
    second.bind(engine.tokenizer, 1)  # the next request still starts at the grammar's start
    assert compiles == [grammar] and second._matcher is not first._matcher
    fresh = _oracle(engine, grammar)
    assert np.array_equal(_allowed(second._matcher), _allowed(fresh))
    assert not np.array_equal(_allowed(first._matcher), _allowed(fresh))
    bad = GrammarFilter("start: nope", STOP_IDS)  # lark text naming a rule it never defines
    for _ in range(2):  # an error is reported every time, never cached
        with pytest.raises(ValueError, match="cannot be compiled"):
            bad.bind(engine.tokenizer, 1)
    for text in others:  # two more grammars: the least recently used one is dropped
        GrammarFilter(text, STOP_IDS).bind(engine.tokenizer, 1)
    assert [k[1] for k in gf._COMPILED] == others
    assert compiles == [grammar, "start: nope", "start: nope", *others]
