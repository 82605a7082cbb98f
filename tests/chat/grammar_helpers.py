"""Shared by the grammar tests (CPU and GPU): the tiny byte-level chat engine, a bounded JSON
schema, and an independent llguidance matcher as the oracle. No jsonschema import here: the
GPU machine may lack it (``is_pet`` checks the schema by hand)."""

from __future__ import annotations

import numpy as np

from edserve.chat.chat_api import prepare_chat
from edserve.engine.logits_filter import LogitsRecorder
from tests.models.mllama.chat_tiny import STOP_IDS
from tests.models.mllama.hf_tiny import synthetic_image

SPACE, NEWLINE = 8, 103  # the byte vocabulary's " " and "\n"
NO_WHITESPACE = {SPACE: -100.0, NEWLINE: -100.0}  # so greedy random weights cannot pad forever
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n", "tag"],
          "properties": {"kind": {"enum": ["cat", "dog"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"type": "string", "maxLength": 4}}}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}


def _build(folder, context_length: int = 256, **kw):
    from edserve.runtime import build_engine
    return build_engine(model=str(folder), device=kw.pop("device", "cpu"), dtype="float32",
                        context_length=context_length, max_running_requests=8, **kw)


def _messages(text: str = "a pet as json", seed: int = 0) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": synthetic_image(80, 40, seed)},
                                         {"type": "text", "text": text}]}]


def _allowed(matcher) -> np.ndarray:
    """[vocab] bool from an independent matcher's bitmask (bit t%8 of byte t//8)."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                         bitorder="little").astype(bool)


def _oracle(engine, grammar: str):
    import llguidance

    tok = engine.tokenizer
    vocab = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(True),
                                   eos_token=list(STOP_IDS))
    return llguidance.LLMatcher(vocab, grammar)


def _run(engine, messages, response_format, record: bool = False, **kw):
    request, tok = prepare_chat(engine, messages, response_format=response_format, **kw)
    rec = LogitsRecorder()
    if record:  # before the grammar filter: the logits it is shown
        request.logits_processors.insert(len(request.logits_processors) - 1, rec)
    return request, rec


def is_pet(value) -> bool:
    """``value`` valid against :data:`SCHEMA` (checked by hand)."""
    return (isinstance(value, dict) and set(value) == {"kind", "n", "tag"}
            and value["kind"] in ("cat", "dog") and isinstance(value["n"], int)
            and not isinstance(value["n"], bool) and 0 <= value["n"] <= 999
            and isinstance(value["tag"], str) and len(value["tag"]) <= 4)
