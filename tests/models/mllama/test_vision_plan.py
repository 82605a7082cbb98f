"""The mask-free "grouped" vision attention plan equals HF's masked attention ("masked").

Random weights (every parameter, gates and embeddings included) on a small vision config with
pad-to-8 tokens (P = 17, Ppad = 24); float64 for exactness, float32 as the engine runs on CPU.
"""

from __future__ import annotations

import pytest
import torch

from edserve.kernels.fa3_attention import fa3_unsupported
from edserve.models.mllama.config import MllamaVisionConfig
from edserve.models.mllama.vision import MllamaVisionModel
from edserve.models.mllama.vision_plan import VISION_PLANS, grouped_plan

CFG = MllamaVisionConfig(hidden_size=32, attention_heads=4, intermediate_size=48,
                         num_hidden_layers=3, num_global_layers=2, image_size=56,
                         intermediate_layers_indices=(0, 2), vision_output_dim=96)
P, PPAD, T = 17, 24, 4


def _model(dtype: torch.dtype, semantics: str = "hf") -> MllamaVisionModel:
    torch.manual_seed(0)
    m = MllamaVisionModel(CFG, semantics)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.to(dtype).eval()


def _inputs(tiles: list[int], dtype: torch.dtype):
    g = torch.Generator().manual_seed(len(tiles) * 10 + sum(tiles))
    pv = torch.zeros(len(tiles), T, 3, 56, 56, dtype=dtype)
    mask = torch.zeros(len(tiles), T, dtype=torch.int64)
    for n, t in enumerate(tiles):
        pv[n, :t] = torch.randn(t, 3, 56, 56, generator=g, dtype=dtype)
        mask[n, :t] = 1
    ids = torch.tensor([t + n % 2 for n, t in enumerate(tiles)])  # any valid id
    return pv, ids, mask


def _run(m: MllamaVisionModel, plan: str, *args, **kw) -> torch.Tensor:
    m.attention_plan = plan
    with torch.no_grad():
        return m(*args, **kw)


BATCHES = [[1], [2], [3], [4], [4, 1, 2, 3, 1, 4, 2]]


@pytest.mark.parametrize("tiles", BATCHES, ids=str)
def test_grouped_equals_masked_float64(tiles):
    m = _model(torch.float64)
    args = _inputs(tiles, torch.float64)
    want = _run(m, "masked", *args)  # [N, T, P, 96], padding tiles included
    got = _run(m, "grouped", *args)
    assert got.shape == want.shape == (len(tiles), T, P, 96)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("semantics", ["hf", "meta"])
def test_grouped_equals_masked_float32_and_tile_selection(semantics):
    m = _model(torch.float32, semantics)
    tiles = BATCHES[-1]
    args = _inputs(tiles, torch.float32)
    want = _run(m, "masked", *args)
    torch.testing.assert_close(_run(m, "grouped", *args), want, atol=2e-5, rtol=2e-5)
    keep = [5 * T + 1, 0, 13, 2 * T]  # any flat (image, tile) indices, any order
    got = _run(m, "grouped", *args, tiles=keep)  # [4, P, 96]
    torch.testing.assert_close(got, want.flatten(0, 1)[keep], atol=2e-5, rtol=2e-5)


def test_grouped_on_the_triton_kernel_equals_masked():
    """The grouped plan's calls on the Triton dense-attention kernel (CPU: its interpreter),
    written in place into the plan's layout, give HF's masked attention (float32)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA tensors there
    m = _model(torch.float32).to(dev)
    pv, ids, mask = _inputs(BATCHES[-1], torch.float32)
    args = (pv.to(dev), ids.to(dev), mask)
    want = _run(m, "masked", *args)
    m.attention_kernel = "triton"
    torch.testing.assert_close(_run(m, "grouped", *args), want, atol=2e-5, rtol=2e-5)
    assert m.kernel_for(torch.device("cpu"), torch.float32) == "triton"
    m.attention_kernel = "auto"  # auto: a Triton kernel on CUDA in fp16 / bf16, else SDPA
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert m.kernel_for(cpu, torch.bfloat16) == "sdpa"
    assert m.kernel_for(cuda, torch.float32) == "sdpa"
    if torch.cuda.is_available():  # FA3 where its library loads (Hopper, bf16); then TMA
        tma = torch.cuda.get_device_capability()[0] >= 9  # (Hopper+) where it reads the head
        fa3 = fa3_unsupported(cuda, torch.bfloat16, 80) is None  # dim, else pointers
        assert m.kernel_for(cuda, torch.bfloat16) == ("fa3" if fa3 else "triton")  # head dim 8
        hd80 = MllamaVisionModel(MllamaVisionConfig(
            hidden_size=160, attention_heads=2, intermediate_size=32, num_hidden_layers=1,
            num_global_layers=1, image_size=56, intermediate_layers_indices=(0,),
            vision_output_dim=320))
        assert hd80.kernel_for(cuda, torch.bfloat16) == ("fa3" if fa3 else "tma" if tma
                                                         else "triton")
        assert hd80.kernel_for(cuda, torch.float16) == ("tma" if tma else "triton")


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="unknown vision attention kernel"):
        MllamaVisionModel(CFG, attention_kernel="flash9")


def test_padding_queries_see_only_real_keys():
    """The oracle itself: a padding token's output must not depend on other padding tokens,
    a real token's must (HF masks a pair only when both are padding)."""
    m = _model(torch.float64)
    pv, ids, mask = _inputs([1, 1], torch.float64)
    base = _run(m, "grouped", pv, ids, mask)
    pv2 = pv.clone()
    pv2[0, 3] = 1.0  # image 0's last padding tile (masked out by ar_mask)
    moved = _run(m, "grouped", pv2, ids, mask)
    assert (moved[0, 0] - base[0, 0]).abs().max() > 1e-6  # real tokens see padding tiles
    torch.testing.assert_close(moved[1], base[1], atol=0, rtol=0)  # images are independent


def test_grouped_plan_layout():
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    plan = grouped_plan(mask, P, PPAD, torch.device("cpu"))
    L = T * PPAD
    assert plan.groups == ((0, 2, P), (2, 3, 2 * P), (3, 4, 4 * P))
    assert torch.equal(plan.src.sort().values, torch.arange(4 * L))  # a permutation
    assert torch.equal(plan.dst[plan.src], torch.arange(4 * L))
    # plan image 0 = HF image 1: its real tokens (tile 0, patches 0..16) first, in order
    assert plan.src[:P].tolist() == [L + j for j in range(P)]
    assert plan.src[P:P + PPAD - P].tolist() == [L + j for j in range(P, PPAD)]
    # plan image 3 = HF image 0 (4 tiles): tile 1's first patch follows tile 0's 17 patches
    assert plan.src[3 * L + P].item() == PPAD
    assert plan.tile_index()[3 * L + P].item() == 1


@pytest.mark.parametrize("plan", sorted(VISION_PLANS))
def test_image_without_valid_tile_is_rejected(plan):
    with pytest.raises(ValueError, match="at least one valid tile"):
        VISION_PLANS[plan](torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]), P, PPAD,
                           torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["sdpa", "triton", "tma", "fa3"])
def test_gpu_grouped_plan_runs_on_flash_and_matches_masked(kernel):
    """bf16 on CUDA at the real sequence (560 px tiles: P = 1601, L = 6432) and head size 80:
    the grouped plan runs with the flash SDPA kernel alone (the masked plan cannot), or on the
    Triton kernel, and agrees with the masked plan within bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel needs compute capability 9.0+")
    if kernel == "fa3" and fa3_unsupported(torch.device("cuda"), torch.bfloat16, 80):
        pytest.skip(fa3_unsupported(torch.device("cuda"), torch.bfloat16, 80))
    cfg = MllamaVisionConfig(hidden_size=160, attention_heads=2, intermediate_size=320,
                             num_hidden_layers=2, num_global_layers=1,
                             intermediate_layers_indices=(0,), vision_output_dim=320)
    torch.manual_seed(0)
    m = MllamaVisionModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    m = m.to("cuda", torch.bfloat16).eval()
    m.attention_kernel = kernel
    pv, ids, mask = _inputs([4, 1, 2, 3], torch.float32)
    pv = torch.nn.functional.interpolate(pv.flatten(0, 1), size=560).view(4, T, 3, 560, 560)
    args = (pv.to("cuda", torch.bfloat16), ids.cuda(), mask)
    want = _run(m, "masked", *args).float()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = _run(m, "grouped", *args).float()
        with pytest.raises(RuntimeError):
            _run(m, "masked", *args)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
