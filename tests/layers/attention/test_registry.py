"""Page-size resolution per strategy and kernel set."""

import pytest

from edserve.layers.attention import resolve_page_size, supported_page_sizes


def test_auto_resolves_to_backend_default():
    assert resolve_page_size("auto", "flat", "torch") == 1
    assert resolve_page_size("auto", "aligned", "triton") == 128
    assert resolve_page_size("auto", "aligned", "triton", restrict=(64,)) == 64


def test_torch_reference_takes_any_page_size():
    for ps in (1, 3, 16, 100, 128):
        assert resolve_page_size(str(ps), "aligned", "torch") == ps


def test_paged_kernel_declares_its_page_sizes():
    sizes = supported_page_sizes("aligned", "triton")
    assert 1 not in sizes and 128 in sizes and 16 in sizes
    assert supported_page_sizes("flat", "triton") is None  # token-indexed: any page size
    with pytest.raises(ValueError, match="page size 1 is not supported by the 'aligned'"):
        resolve_page_size("1", "aligned", "triton")
    assert resolve_page_size("1", "flat", "triton") == 1


def test_xpu_restriction_reproduced():
    assert supported_page_sizes("aligned", "triton", restrict=(64, 128)) == (64, 128)
    with pytest.raises(ValueError, match="supported: \\[64, 128\\]"):
        resolve_page_size("16", "aligned", "triton", restrict=(64, 128))


@pytest.mark.parametrize("bad", ["0", "-4", "big"])
def test_bad_page_size(bad):
    with pytest.raises(ValueError, match="--page-size"):
        resolve_page_size(bad, "flat", "torch")
