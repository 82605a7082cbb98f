"""The Whisper decoder's residual adds fused into its LayerNorms (``edserve.layers.add_norm``):
every add goes to the next norm and the last one to the final norm, in prefill and decode steps;
with the Triton kernel (interpreter on CPU) the engine gives the torch ops' tokens and logits."""

from __future__ import annotations

import pytest
import torch

from edserve.layers.add_norm import TORCH_ADD_NORM, TRITON_ADD_NORM, AddNormOps


def _greedy(engine, mels, steps: int = 4):
    from edserve.engine.logits_filter import LogitsRecorder
    from edserve.engine.request import GenerateRequest, SamplingParams

    recs = [LogitsRecorder() for _ in mels]
    outs = engine.generate([GenerateRequest([50257, 50362], m, SamplingParams(
        max_new_tokens=steps, ignore_eos=True), logits_processors=[r])
        for m, r in zip(mels, recs, strict=True)])
    engine.check_integrity()
    return [o.token_ids for o in outs], [torch.stack(r.rows).float() for r in recs]


def test_decoder_adds_go_to_the_next_norm_and_the_kernel_gives_the_torch_tokens(random_whisper):
    pytest.importorskip("triton")
    from edserve.runtime import build_engine

    gen = torch.Generator().manual_seed(3)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(2)]
    engine = build_engine(model=str(random_whisper), device="cpu", max_running_requests=2,
                          cuda_graph=False)
    model = engine.model
    assert model.add_norm is None  # by device: the torch ops on CPU
    ref_tokens, ref_logits = _greedy(engine, mels)

    model.add_norm = TORCH_ADD_NORM  # what CPU picks: the same ops, bit for bit
    tokens, logits = _greedy(engine, mels)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))

    calls: list[bool] = []

    def counted(norm, x, delta=None, gate=None):
        calls.append(delta is not None)
        return TRITON_ADD_NORM.add_layer_norm(norm, x, delta, gate)

    model.add_norm = AddNormOps("counted", counted)
    try:
        tokens, logits = _greedy(engine, mels)
    finally:
        model.add_norm = None
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    layers = model.config.decoder_layers
    per_forward = [False] + [True] * (3 * layers)  # 3 norms per layer + the final one
    assert len(calls) % len(per_forward) == 0 and len(calls) >= 2 * len(per_forward)
    assert calls == per_forward * (len(calls) // len(per_forward))


def test_one_bf16_row_on_cpu_takes_the_matrix_vector_logits(random_whisper, monkeypatch):
    """compute_logits' one-row bf16 CPU path (torch.mv) gives F.linear's logits; more rows keep
    F.linear."""
    import torch.nn.functional as F

    from edserve.runtime import build_engine

    engine = build_engine(model=str(random_whisper), device="cpu", dtype="bfloat16",
                          max_running_requests=1)
    model = engine.model
    weight = model.model.decoder.embed_tokens.weight
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, weight.shape[1], generator=gen).to(torch.bfloat16)
    calls = []
    mv = torch.mv
    monkeypatch.setattr(torch, "mv", lambda *a: calls.append(1) or mv(*a))
    one = model.compute_logits(hidden[:1])
    assert calls == [1] and one.shape == (1, weight.shape[0]) and one.dtype == torch.bfloat16
    torch.testing.assert_close(one, F.linear(hidden[:1], weight), rtol=1e-2, atol=1e-2)
    assert model.compute_logits(hidden).shape == (3, weight.shape[0]) and calls == [1]
