"""``CallScanner`` (the reader of Llama 3 JSON calls behind ``parse_calls`` and the streamed
calls) against a reference built on ``json``: on thousands of generated answers, calls and
broken calls alike, both find the same calls, and each call's ``arguments`` is the model's
own text of its arguments object; any split of the text reads the same."""

from __future__ import annotations

import json
import random

import pytest

from edserve.chat.call_scan import CallScanner
from edserve.chat.tools import parse_calls, parse_tools
from tests.chat.test_tools import CLOCK, WEATHER

NAMES = {"get_weather", "now"}


class _Obj(dict):
    """A decoded JSON object that remembers its keys in order, repeats included."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.keys_seen = [k for k, _ in pairs]


def reference(text: str) -> list[tuple[str, object]] | None:
    """parse_calls before the scanner (json.raw_decode, object by object, ``;`` / whitespace
    between), plus the scanner's one rule more: no ``name`` twice, not both argument keys."""
    decoder = json.JSONDecoder(object_pairs_hook=_Obj, parse_constant=_refuse)
    s, pos, calls = text.strip(), 0, []
    while pos < len(s):
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        keys = obj.keys_seen
        args = obj.get("parameters", obj.get("arguments"))
        if keys.count("name") != 1 or keys.count("parameters") + keys.count("arguments") != 1 \
                or not isinstance(args, dict) or not isinstance(obj["name"], str) \
                or obj["name"] not in NAMES:
            return None
        calls.append((obj["name"], args))
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _refuse(name):
    raise ValueError(name)


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(["Oslo", "a\"b", "}{][", "\\", "é", "", "x\ny"])
    if kind == 1:
        return rng.choice([0, -1, 3.5, 1e20, -2.5e-3, 12345678901234567890])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(["tab\t", "q'"])
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["city", "days", "k", "name", "}"]): _value(rng, depth + 1)
            for _ in range(rng.randrange(3))}


def _dump(value: object, rng: random.Random) -> str:
    return json.dumps(value, ensure_ascii=rng.random() < 0.3,
                      indent=rng.choice([None, None, 2]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))


def _call(rng: random.Random) -> str:
    pairs = [("name", json.dumps(rng.choice(["now", "get_weather"] * 4 + ["nope"]))),
             (rng.choice(["parameters", "parameters", "arguments"]),
              _dump(rng.choice([{}, {"city": "Oslo"}, _value(rng)]), rng))]
    for _ in range(rng.choice([0] * 6 + [1, 2])):
        pairs.append((rng.choice(["x", "name", "arguments", "parameters"]),
                      _dump(_value(rng), rng)))
    rng.shuffle(pairs)
    sp = rng.choice(["", " ", "\n  "])
    return "{" + sp + ("," + sp).join(f'"{k}"{sp}:{sp}{v}' for k, v in pairs) + sp + "}"


def answer(rng: random.Random) -> str:
    text = rng.choice(["", " ", "\n"]) + _call(rng)
    for _ in range(rng.choice([0, 0, 1, 2])):
        text += rng.choice(["", ";", "; ", "\n", " ;\n "]) + _call(rng)
    text += rng.choice(["", "", " ", ";", " and more"])
    if rng.random() < 0.3:  # break it
        at = rng.randrange(len(text) + 1)
        text = rng.choice([text[:at], text[:at] + rng.choice('{}[]",:x\\ 1') + text[at:],
                           text[:at] + text[at + 1:]])
    return text


@pytest.mark.parametrize("seed", range(4))
def test_scanner_finds_what_json_finds(seed):
    rng, req, calls_seen = random.Random(seed), parse_tools([WEATHER, CLOCK]), 0
    for _ in range(1500):
        text = answer(rng)
        want, got = reference(text), parse_calls(text, req)
        assert (want is None) == (got is None), text
        if got:
            calls_seen += 1
            assert [(c.name, json.loads(c.arguments)) for c in got] == want, text
            for c in got:  # the model's own text of the object, verbatim
                assert c.arguments in text and c.arguments[0] + c.arguments[-1] == "{}"
        cut = sorted(rng.choices(range(len(text) + 1), k=2))
        split = CallScanner(NAMES).feed(text[:cut[0]]).feed(text[cut[0]:cut[1]])
        assert split.feed(text[cut[1]:]).result() == CallScanner(NAMES).feed(text).result()
    assert calls_seen > 250  # the generator makes plenty of real calls


def test_failure_is_at_the_first_character_that_rules_calls_out():
    for text, at in [("Hi", 0), ("  [", 2), ('{"name": "nope"', 14), ('{"name": 3', 9),
                     ('{"name": "now", "parameters": [', 30), ('{"a" 1', 5),
                     ('{"name": "now", "parameters": {}} x', 34), ('{"n\\q"', 5),
                     ('{"name": "now", "parameters": {]', 31)]:
        s = CallScanner(NAMES).feed(text)
        assert s.failed and s.pos == at, (text, s.pos)
    s = CallScanner(NAMES).feed('{"name": "now", "parameters": {"a": [1, "}"')
    assert not s.failed and s.calls[0].named and s.calls[0].args_end is None
    assert s.result() is None  # not finished: not calls (yet)
