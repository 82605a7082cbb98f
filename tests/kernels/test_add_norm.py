"""Triton residual add + LayerNorm (CPU interpreter without CUDA) vs float64 references and the
torch ops it replaces (``x + gate * delta`` then ``nn.LayerNorm``: the same rounding points)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edserve.kernels.add_norm import add_layer_norm, layer_norm  # noqa: E402
from edserve.layers.add_norm import add_layer_norm_torch, add_layer_norm_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter needs CPU tensors
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_same_rounding(got, want, x, delta):
    """The residual add rounds exactly as torch's: bit-equal, except under the CPU interpreter
    in bf16, whose fp32 -> bf16 cast truncates (the GPU rounds to nearest even): an ulp of the
    operands for each of the (up to two) roundings."""
    if got.dtype == torch.bfloat16 and not got.is_cuda:
        bound = 2 ** -6 * (x.double().abs() + delta.double().abs())
        assert ((got.double() - want.double()).abs() <= bound).all()
    else:
        assert torch.equal(got, want)


def _inputs(shape, dtype, seed, gated):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(DEVICE, dtype)
    delta = (torch.randn(shape, generator=g) * 2).to(DEVICE, dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype)
    b = torch.randn(d, generator=g).to(DEVICE, dtype)
    gate = torch.tensor([0.7], dtype=dtype, device=DEVICE).tanh() if gated else None
    return x, delta, w, b, gate


def _ref64(x, delta, w, b, gate, eps):
    """float64 with the kernel's rounding points: gate * delta and the sum rounded to x's
    dtype, then LayerNorm of the rounded sum in float64."""
    d = delta if gate is None else (gate.double() * delta.double()).to(x.dtype)
    new_x = (x.double() + d.double()).to(x.dtype)
    n64 = new_x.double()
    mean = n64.mean(-1, keepdim=True)
    var = (n64 - mean).pow(2).mean(-1, keepdim=True)
    return new_x, (n64 - mean) / torch.sqrt(var + eps) * w.double() + b.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 80), (1, 384), (4, 100), (0, 32), (3, 1100),
                                   (2, 8192), (70, 24)], ids=str)
def test_add_layer_norm_vs_float64_and_torch(dtype, gated, shape):
    x, delta, w, b, gate = _inputs(shape, dtype, sum(shape) + gated, gated)
    new_x, normed = add_layer_norm(x, delta, w, b, 1e-5, gate)
    assert new_x.shape == normed.shape == x.shape and new_x.dtype == normed.dtype == dtype
    assert new_x.is_contiguous() and normed.is_contiguous()
    want_x, ref = _ref64(x, delta, w, b, gate, 1e-5)
    _assert_same_rounding(new_x, want_x, x, delta)
    torch.testing.assert_close(normed.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    norm = torch.nn.LayerNorm(shape[-1], eps=1e-5, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        norm.bias.copy_(b)
        tx, tn = add_layer_norm_torch(norm, x, delta, gate)  # the ops it replaces
    _assert_same_rounding(new_x, tx, x, delta)
    torch.testing.assert_close(normed, tn, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_layer_norm_matches_torch(dtype):
    x, _, w, b, _ = _inputs((6, 3, 96), dtype, 3, False)
    got = layer_norm(x, w, b, 1e-6)
    torch.testing.assert_close(got, F.layer_norm(x, (96,), w, b, 1e-6), atol=TOL[dtype],
                               rtol=TOL[dtype])
    new_x, normed = add_layer_norm(x, None, w, b, 1e-6)
    assert new_x is x and torch.equal(normed, got)
    no_affine = layer_norm(x, None, None, 1e-6)
    torch.testing.assert_close(no_affine, F.layer_norm(x, (96,), eps=1e-6), atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_fp32_weights_with_bf16_rows():
    """Norm parameters kept in fp32 next to bf16 activations: read as fp32, as torch's mixed
    dtype LayerNorm (output in x's dtype)."""
    x, delta, w, b, _ = _inputs((5, 72), torch.bfloat16, 9, False)
    new_x, normed = add_layer_norm(x, delta, w.float(), b.float(), 1e-5)
    assert normed.dtype == torch.bfloat16
    _, ref = _ref64(x, delta, w, b, None, 1e-5)
    torch.testing.assert_close(normed.double(), ref, atol=2e-2, rtol=2e-2)


def test_strided_and_flattened_rows():
    """Rows 80 apart (a column slice) and a flattened [N * S, d] view of a 3-D stream."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 80, generator=g).to(DEVICE)
    x, delta = base[:, 8:72], torch.randn(6, 80, generator=g).to(DEVICE)[:, 4:68]
    w, b = torch.rand(64, device=DEVICE) + 0.5, torch.randn(64, device=DEVICE)
    new_x, normed = add_layer_norm(x, delta, w, b, 1e-5)
    want_x, ref = _ref64(x, delta, w, b, None, 1e-5)
    assert torch.equal(new_x, want_x) and torch.equal(base[:, 8:72], x)  # x is not written
    torch.testing.assert_close(normed.double(), ref, atol=1e-5, rtol=1e-5)
    s3 = torch.randn(2, 7, 48, generator=g).to(DEVICE)
    d3 = torch.randn(2, 7, 48, generator=g).to(DEVICE)
    w3, b3 = torch.ones(48, device=DEVICE), torch.zeros(48, device=DEVICE)
    flat = add_layer_norm(s3.view(-1, 48), d3.view(-1, 48), w3, b3, 1e-5)
    full = add_layer_norm(s3, d3, w3, b3, 1e-5)
    assert torch.equal(flat[0].view(2, 7, 48), full[0])
    assert torch.equal(flat[1].view(2, 7, 48), full[1])


def test_constant_rows_and_large_offsets():
    """A constant row normalises to the bias (variance 0 -> eps only); a large common offset
    does not swamp the variance (two-pass in fp32)."""
    x = torch.full((2, 40), 3.0, device=DEVICE)
    x[1] = 1000.0 + torch.linspace(-1, 1, 40, device=DEVICE)
    b = torch.arange(40, dtype=torch.float32, device=DEVICE) / 10
    new_x, normed = add_layer_norm(x, torch.zeros_like(x), torch.ones(40, device=DEVICE), b,
                                   1e-5)
    assert torch.equal(normed[0], b)
    _, ref = _ref64(x, torch.zeros_like(x), torch.ones(40, device=DEVICE), b, None, 1e-5)
    torch.testing.assert_close(normed.double(), ref, atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="delta must match"):
        add_layer_norm(x, x[:, :4], w, w, 1e-5)
    with pytest.raises(ValueError, match="delta must match"):
        add_layer_norm(x, x.half(), w, w, 1e-5)
    with pytest.raises(ValueError, match="gate must be"):
        add_layer_norm(x, x, w, w, 1e-5, gate=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="gate must be"):
        add_layer_norm(x, None, w, w, 1e-5, gate=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        add_layer_norm(x, x, torch.ones(4, device=DEVICE), w, 1e-5)
    with pytest.raises(ValueError, match="bias must be"):
        add_layer_norm(x, x, w, w.long(), 1e-5)
    with pytest.raises(ValueError, match="bias must be"):
        add_layer_norm(x, x, w, torch.ones(16, device=DEVICE)[::2], 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_layer_norm(x.t(), None, None, None, 1e-5)
    with pytest.raises(ValueError, match="last dimension"):
        add_layer_norm(torch.randn(2, 0, device=DEVICE), None, None, None, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_matches_torch_ops_at_large_v3_width():
    """Compiled on the GPU at Whisper large-v3's rows ([16 * 1500, 1280] bf16), gated and not:
    through the encoders' op set the new residual equals torch's add bit for bit (the raw
    kernel's gated residual: no larger error against float64 than torch's); the normed rows are
    within a bf16 rounding of torch's LayerNorm (only fp32 sum order and rsqrt differ)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16 * 1500, 1280, device="cuda", generator=g).bfloat16()
    delta = torch.randn(16 * 1500, 1280, device="cuda", generator=g).bfloat16()
    norm = torch.nn.LayerNorm(1280, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
        norm.bias.normal_(generator=g)
    for gate in (None, torch.tensor([0.9], device="cuda").tanh().bfloat16()):
        with torch.no_grad():
            got = add_layer_norm_triton(norm, x, delta, gate)  # the encoders' op set
            want = add_layer_norm_torch(norm, x, delta, gate)
            raw = add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps, gate)
        assert torch.equal(got[0], want[0])
        assert (got[1] != want[1]).float().mean() < 0.01
        # the kernel's own gate: its residual's error against float64 no larger than torch's
        exact = x.double() + (1 if gate is None else gate.double()) * delta.double()
        assert (raw[0].double() - exact).abs().max() <= (want[0].double() - exact).abs().max()
        torch.testing.assert_close(got[1], want[1], atol=2 ** -6, rtol=2 ** -7)
