"""edserve.whisper.usage: audio tokens come from the encoder input, or from the held region
when a request reuses one without its input (the engine's extent then), so a fallback retry
counts as its first attempt."""

from __future__ import annotations

import torch

from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import EncoderKV, FinishReason, GenerateRequest
from edserve.whisper.usage import TokenUsage, audio_tokens


def _output(rid: str, n: int) -> GenerateOutput:
    return GenerateOutput(rid, list(range(n)), [-0.1] * n, FinishReason.STOP)


def test_a_retry_without_its_input_counts_the_handles_encoder_length():
    first = GenerateRequest([1, 2, 3], torch.zeros(80, 3000), keep_encoder=True)
    handle = EncoderKV(torch.arange(1500), 1500, 1500)
    retry = GenerateRequest([1, 2, 3], None, encoder_kv=handle)
    with_input = GenerateRequest([1, 2, 3], torch.zeros(80, 3000), encoder_kv=handle)
    assert audio_tokens(first) == audio_tokens(retry) == audio_tokens(with_input) == 1500
    assert audio_tokens(GenerateRequest([1], None)) == 0  # no encoder at all
    usage = TokenUsage()
    usage.add(first, _output(first.rid, 4))
    usage.add(retry, _output(retry.rid, 2))
    assert (usage.text_tokens, usage.audio_tokens, usage.output_tokens) == (6, 3000, 6)
    assert usage.openai()["input_token_details"] == {"text_tokens": 6, "audio_tokens": 3000}
    assert usage.openai()["total_tokens"] == 6 + 3000 + 6
