"""``--encoder-dtype bfloat16``: a Whisper encoder in bfloat16 beside a float32 or int8 decoder.

The encoder is compute-bound (``[1500, d] x [d, 4d]`` products per layer) and the decoder is
bound by memory and host work per step, so on CPUs with AMX tiles their best dtypes differ:
oneDNN's AMX bfloat16 GEMMs ran tiny.en's encoder at 45-48 ms per 30 s window on a 2-core
Xeon where fbgemm's dynamic int8 linears (AVX-512 VNNI, no AMX) took 98-105 ms, while int8
decode steps were the fastest (``benchmarks/RESULTS.md``, wave 21). So under
``--quantization int8`` on such a CPU, ``--encoder-dtype auto`` keeps the encoder's linears
unquantized and runs the whole encoder (convolutions, layers, norms) in bfloat16; its output
is cast back to the compute dtype before the decoder's cross K/V projection reads it.

Applied once after loading, after :func:`~edserve.models.quantize.quantize_model` (which then
skips the encoder). Whisper models only. What ``auto`` becomes on a machine:
:func:`edserve.runtime.settings.resolve_encoder_dtype`.
"""

from __future__ import annotations

from typing import Any

import torch


def encoder_in_bf16(model: Any) -> Any:
    """The encoder of a Whisper ``model`` in bfloat16, in place (``ValueError`` for other
    models); ``model.encode`` casts log-mels to it and its states back."""
    from edserve.models.whisper import WhisperForConditionalGeneration

    if not isinstance(model, WhisperForConditionalGeneration):
        raise ValueError(f"--encoder-dtype bfloat16 supports Whisper models only, got "
                         f"{type(model).__name__}")
    model.model.encoder.to(torch.bfloat16)
    return model
