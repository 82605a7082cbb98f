"""Per-row fp8 activation quantization in one Triton pass (edserve.kernels.fp8_quant) against
the torch ops it replaces (``quantize_rows`` of ``F.gelu``'s output) and a float64 oracle. On
CPU the interpreter runs it with an fp32 output (its fp8 cast does not round like a GPU's);
the fp8 cast itself is checked on an fp8 GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edserve.kernels.fp8_quant import MAX_QUANT_DIM, quantize_rows_fp8  # noqa: E402
from edserve.models.fp8 import FP8, FP8_MAX, quantize_rows  # noqa: E402

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
APPROX = {None: None, "exact": "none", "tanh": "tanh"}


def _g(x: torch.Tensor, gelu: str | None) -> torch.Tensor:
    return x if gelu is None else F.gelu(x, approximate=APPROX[gelu])


def _unrounded_reference(x: torch.Tensor, gelu: str | None):
    """``quantize_rows``'s values before its fp8 cast, and its scales."""
    y = _g(x, gelu)
    _, scale = quantize_rows(y)
    return torch.div(y, scale).clamp(-FP8_MAX, FP8_MAX), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gelu", [None, "exact", "tanh"])
@pytest.mark.parametrize("shape", [(7, 64), (3, 100), (1, 1280), (0, 16)], ids=str)
def test_scaled_values_match_the_torch_ops(dtype, gelu, shape):
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(DEVICE, dtype)
    q, scale = quantize_rows_fp8(x, gelu, out_dtype=torch.float32)
    want, want_scale = _unrounded_reference(x, gelu)
    assert q.shape == shape and scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    if gelu is None:  # the same scales; x * (1 / scale) within 2 fp32 ulps of x / scale
        assert torch.equal(scale, want_scale)
        torch.testing.assert_close(q, want, rtol=2.5e-7, atol=0)
    else:  # erf/exp of another library: the GELU may round to the neighbouring value
        torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)
        torch.testing.assert_close(q, want, rtol=2e-2, atol=0.5)
    if shape[0]:  # float64 oracle: every row's largest magnitude lands on 448
        torch.testing.assert_close(q.abs().amax(1).cpu(), torch.full((shape[0],), FP8_MAX),
                                   rtol=1e-6, atol=0)
        ref = _g(x.double(), gelu)
        tol = 2e-2 if dtype == torch.bfloat16 and gelu else 1e-5
        torch.testing.assert_close((q.double() * scale.double()), ref.double(),
                                   atol=tol * float(ref.abs().max()), rtol=0)


def test_zero_rows_saturation_and_strided_rows():
    x = torch.zeros(3, 32, device=DEVICE)
    x[1, 5] = 7.0
    x[2] = torch.linspace(-1000, 1000, 32)
    q, scale = quantize_rows_fp8(x, out_dtype=torch.float32)
    assert torch.equal(q[0], torch.zeros(32, device=DEVICE))
    assert float(scale[0]) == pytest.approx(1e-12)
    assert float(q[1, 5]) == FP8_MAX and float(scale[1]) == pytest.approx(7 / FP8_MAX)
    assert float(q[2].min()) == pytest.approx(-FP8_MAX)
    assert float(q[2].max()) == pytest.approx(FP8_MAX)
    wide = torch.randn(4, 80, device=DEVICE)[:, 8:72]  # rows 80 apart, 64 wide
    got, s = quantize_rows_fp8(wide, out_dtype=torch.float32)
    want, ws = _unrounded_reference(wide.contiguous(), None)
    assert torch.equal(s, ws)
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="gelu must be one of"):
        quantize_rows_fp8(torch.zeros(2, 4, device=DEVICE), "relu")
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        quantize_rows_fp8(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="row length"):
        quantize_rows_fp8(torch.zeros(1, MAX_QUANT_DIM + 1, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows_fp8(torch.zeros(4, 8, device=DEVICE).t())


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs an fp8 GPU")
@pytest.mark.parametrize("gelu", [None, "exact", "tanh"])
def test_fp8_cast_matches_quantize_rows_on_the_gpu(gelu):
    """The GPU's fp8 cast rounds as torch's does: the kernel gives ``quantize_rows(g(x))``."""
    x = (torch.randn(3000, 1280, device="cuda") * 3).to(torch.bfloat16)
    q, scale = quantize_rows_fp8(x, gelu)
    want, want_scale = quantize_rows(_g(x, gelu))
    assert q.dtype == FP8
    differ = float((q.view(torch.uint8) != want.view(torch.uint8)).float().mean())
    print(f"gelu={gelu}: {differ:.2e} of the codes differ from quantize_rows'")
    if gelu is None:  # the same scales; codes differ only at rounding midpoints (module doc)
        assert torch.equal(scale, want_scale) and differ < 1e-5, differ
    else:  # a GELU value one bf16 step apart moves at most a few codes
        assert differ < 1e-3, differ
        torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)
