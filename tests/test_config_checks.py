"""``EngineConfig``'s checks (edserve.config_checks): a bad value or an impossible
combination is a ValueError naming the flag, raised at construction."""

from __future__ import annotations

import pytest

from edserve.config import EngineConfig


@pytest.mark.parametrize("kwargs,match", [
    ({"encoder_kv": "ragged", "cuda_graph": True}, "cannot be used with --encoder-kv ragged"),
    ({"encoder_kv": "bogus"}, "--encoder-kv must be one of"),
    ({"max_running_requests": 0}, "--max-running-requests"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
    ({"quantization": "int4"}, "--quantization must be one of"),
    ({"tensor_parallel_size": 2, "cuda_graph": True}, "--cuda-graph cannot be used"),
    ({"tensor_parallel_size": 2, "decoder_gelu": "tanh"}, "--decoder-gelu tanh"),
    ({"tensor_parallel_size": 2, "encoder_attention": "tma"}, "--encoder-attention tma"),
    ({"prompt_cuda_graph_max_tokens": -1}, "--prompt-cuda-graph-max-tokens"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
])
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_replace_checks_again():
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        EngineConfig().replace(threads=0)
