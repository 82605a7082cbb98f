"""The small kernel benchmarks' dry runs (tiny shapes, the Triton interpreter): each variant is
checked against torch before it is timed, so a wrong kernel fails here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_row_topk_dry_run(capsys):
    import row_topk_gpu

    assert row_topk_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton default" in out


def test_beam_choice_dry_run(capsys):
    """Both beam choices run the same steps and end in equal states (asserted inside)."""
    import beam_choice_gpu

    assert beam_choice_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and out.rstrip().endswith("True |")


def test_self_attn_decode_dry_run(capsys):
    """The paged kernel at both key-block caps is checked against the flat kernel."""
    import self_attn_decode_gpu

    assert self_attn_decode_gpu.main(["--dry-run"]) == 0
    assert "| 3 |" in capsys.readouterr().out


def test_decode_gemm_dry_run(capsys):
    import decode_gemm_gpu

    assert decode_gemm_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "one layer's 6 GEMMs" in out and "triton 16x32/s1" in out


def test_mllama_kernels_dry_run(capsys):
    """Every split factor of the cross- and self-attention shapes is checked against the
    unsplit output, and the row-wise kernels against torch, before they are timed."""
    import mllama_kernels

    assert mllama_kernels.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "self   3 rows" in out and "8:" in out and "rms_norm" in out


def _diffs(out: str, marker: str) -> list[float]:
    """The last column (max difference) of every printed row containing ``marker``."""
    return [float(line.split()[-1]) for line in out.splitlines()
            if marker in line and "BEST" not in line and "n/a" not in line]


def test_attn_headdim_dry_run(capsys):
    """SDPA at native and padded head dims, and the Triton dense attention, each checked
    against float32 SDPA."""
    import attn_headdim

    assert attn_headdim.main(["--dry-run", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    diffs = _diffs(out, "triton 16x16")
    assert len(diffs) == 4 and max(diffs) < 1e-5, out
    assert out.count("BEST triton") == 4


def test_dense_attn_variants_dry_run(capsys):
    """Every layout of head dim 80's two dots (64 + 16 or zero-padded 128) equals SDPA."""
    import dense_attn_variants

    assert dense_attn_variants.main(["--dry-run", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    diffs = _diffs(out, "16x16 w4 s1")
    assert len(diffs) == 12 and max(diffs) < 1e-5, out


def test_logits_gemm_dry_run(capsys):
    import logits_gemm_gpu

    assert logits_gemm_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "exact" in out and "padded 112 + copy" in out and "engine" in out and "out= view" in out
    assert "max diff 0.0e+00" in out


def test_attn_tma_dry_run(capsys):
    """The pointer-load and TMA-fed kernels at a head dim of one chunk (64) and of two (80),
    each checked against float64 SDPA (bf16 inputs), before they would be timed."""
    import attn_tma_gpu

    assert attn_tma_gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    diffs = _diffs(out, "tma 32x16") + _diffs(out, "dense (pointer")
    assert len(diffs) == 4 and max(diffs) < 2e-2, out
    assert out.count("BEST tma") == 2


def test_mllama_pixels_dry_run(capsys):
    """The old host concatenation and stack_pixels give equal tensors (checked inside)."""
    import mllama_pixels_gpu

    assert mllama_pixels_gpu.main(["--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("True")
