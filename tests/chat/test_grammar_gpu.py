"""GPU: grammar rows (``response_format``) inside CUDA-graph decode batches.

The tiny random Mllama (fp32, Triton kernels, decode graphs and sampling graphs on) with the
byte-level tokenizer: three JSON-schema rows batched with two free rows, greedy. The free rows'
tokens must equal their solo run (a grammar row's sync and mask do not disturb the graph rows);
every grammar row's tokens must be the argmax of its recorded logits over what an independent
llguidance matcher allows, and its text valid against the schema; the KV cache is whole after.
"""

from __future__ import annotations

import json

import pytest
import torch

from edserve.chat.chat_api import prepare_chat
from edserve.engine.request import FinishReason

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_grammar_rows_in_graph_batches(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("llguidance")
    from edserve.runtime import build_engine
    from tests.chat.grammar_helpers import (
        AS_SCHEMA,
        NO_WHITESPACE,
        _allowed,
        _messages,
        _oracle,
        _run,
        is_pet,
    )
    from tests.models.mllama.chat_tiny import STOP_IDS, save_byte_chat_tokenizer
    from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny

    save_hf_tiny(build_hf_tiny(), tmp_path)
    save_byte_chat_tokenizer(tmp_path)
    eng = build_engine(model=str(tmp_path), device="cuda", dtype="float32",
                       attention_backend="triton", cuda_graph=True, cuda_graph_max_bs=8,
                       context_length=256, max_running_requests=8)

    def free(seed):
        return prepare_chat(eng, _messages("hello", seed), max_tokens=12)[0]

    solo = [eng.generate([free(s)])[0].token_ids for s in (1, 2)]
    grammar_rows = [_run(eng, _messages(seed=s), AS_SCHEMA, record=True, max_tokens=60,
                         logit_bias=NO_WHITESPACE) for s in range(3)]
    outs = eng.generate([r for r, _ in grammar_rows] + [free(1), free(2)])
    eng.check_integrity()
    assert [o.token_ids for o in outs[3:]] == solo
    from edserve.chat.response_format import response_grammar
    grammar = response_grammar(AS_SCHEMA)
    for (_, rec), out in zip(grammar_rows, outs[:3], strict=True):
        assert out.finish_reason == FinishReason.STOP
        oracle = _oracle(eng, grammar)
        for step, logits in enumerate(rec.rows):
            allowed = torch.from_numpy(_allowed(oracle)[:logits.numel()])
            masked = logits.float().cpu().masked_fill(~allowed, float("-inf"))
            chosen = int(masked.argmax())
            if step == len(out.token_ids):
                assert chosen in STOP_IDS and oracle.is_accepting()
                break
            assert chosen == out.token_ids[step] and oracle.consume_token(chosen)
        assert is_pet(json.loads(eng.tokenizer.decode(out.token_ids)))
