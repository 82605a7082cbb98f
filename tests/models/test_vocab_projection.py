"""``vocab_projection``: the tied output projection's paths give ``F.linear``'s logits; a model
on CUDA keeps its unaligned vocabulary as the first rows of a padded buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edserve.models.vocab_projection import pad_rows, padded_width, vocab_logits


def test_padded_width():
    assert padded_width(51864, 2) is None and padded_width(51864, 4) is None  # tiny.en
    assert padded_width(51866, 2) == 51872 and padded_width(51865, 2) == 51872  # multilingual
    assert padded_width(51866, 4) == 51868 and padded_width(128256, 2) is None  # Mllama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5])
def test_padded_buffer_gives_linear_as_strided_view(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    V, d = 1001, 24  # odd: padded in both dtypes
    weight = torch.randn(V, d, generator=g).to(dtype)
    hidden = torch.randn(rows, d, generator=g).to(dtype)
    buf = pad_rows(weight)
    assert buf.shape == (padded_width(V, buf.element_size()), d)
    assert torch.equal(buf[:V], weight) and not buf[V:].any()
    got = vocab_logits(hidden, buf[:V], buf)
    assert got.shape == (rows, V) and got.dtype == dtype and got.stride() == (buf.shape[0], 1)
    torch.testing.assert_close(got, F.linear(hidden, weight), atol=1e-2, rtol=1e-2)
    # consumers read rows by stride: argmax / in-place masking see exactly V columns
    assert torch.equal(got.argmax(-1), got.contiguous().argmax(-1))
    got[:, :3] = float("-inf")
    assert torch.isinf(got[:, :3]).all() and torch.isfinite(got[:, 3:]).all()


def test_a_replaced_weight_is_not_read_from_a_stale_buffer():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(1001, 24, generator=g)
    hidden = torch.randn(3, 24, generator=g)
    stale = pad_rows(weight)
    out = vocab_logits(hidden, weight, stale)  # weight is not the buffer's memory
    assert out.is_contiguous() and torch.equal(out, F.linear(hidden, weight))
    assert pad_rows(torch.randn(1000, 8)) is None  # aligned already


def test_cpu_one_bf16_row_by_mv():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1001, 24, generator=g)
    hidden = torch.randn(1, 24, generator=g)
    one = vocab_logits(hidden.bfloat16(), weight.bfloat16())
    assert one.shape == (1, 1001)
    torch.testing.assert_close(one.float(), F.linear(hidden, weight), atol=0.1, rtol=2e-2)


def test_cpu_model_keeps_its_embedding():
    from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=1001, num_mel_bins=8, d_model=16, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_source_positions=8, max_target_positions=16)
    model = WhisperForConditionalGeneration(cfg)
    before = model.model.decoder.embed_tokens.weight
    model.align_vocabulary()
    assert model.vocab_rows is None and model.model.decoder.embed_tokens.weight is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [51866, 51864])
def test_cuda_model_aligns_a_multilingual_vocabulary(vocab):
    from edserve.models.whisper import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=8, d_model=64, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_source_positions=8, max_target_positions=16)
    model = WhisperForConditionalGeneration(cfg).cuda().bfloat16()
    weight = model.model.decoder.embed_tokens.weight.detach().clone()
    model.align_vocabulary()
    emb = model.model.decoder.embed_tokens.weight
    assert torch.equal(emb, weight)
    hidden = torch.randn(64, 64, device="cuda").bfloat16()
    out = model.compute_logits(hidden)
    torch.testing.assert_close(out, F.linear(hidden, weight), atol=2e-2, rtol=2e-2)
    if vocab == 51866:
        assert model.vocab_rows.shape == (51872, 64) and out.stride(0) == 51872
        assert emb.data_ptr() == model.vocab_rows.data_ptr()
    else:
        assert model.vocab_rows is None and out.is_contiguous()
