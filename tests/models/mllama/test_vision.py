"""Vision encoder + projector vs HF ``MllamaForConditionalGeneration`` on the tiny config."""

from __future__ import annotations

import pytest
import torch

from edserve.models.mllama import load_mllama
from edserve.multimodal.mllama_image import MllamaImageConfig, preprocess_images
from tests.models.mllama.hf_tiny import synthetic_image

# (W, H) of 1-, 2- and 4-tile images at tile size 56.
SIZES = {1: (50, 40), 2: (100, 50), 4: (300, 40)}


@pytest.fixture(scope="module")
def ours(tiny_folder):
    return load_mllama(tiny_folder)


def _hf_projected(hf, inp) -> torch.Tensor:
    """HF's projected vision states ``[N_img, T, P, hidden]``."""
    with torch.no_grad():
        m = hf.model
        out = m.vision_model(pixel_values=inp.pixel_values[None],
                             aspect_ratio_ids=inp.aspect_ratio_ids[None],
                             aspect_ratio_mask=inp.aspect_ratio_mask[None]).last_hidden_state
        return m.multi_modal_projector(out)[0]


@pytest.mark.parametrize("tiles", [1, 2, 4])
def test_vision_matches_hf(ours, hf_tiny, tiles):
    inp = preprocess_images([synthetic_image(*SIZES[tiles], seed=tiles)],
                            MllamaImageConfig(image_size=56))
    assert inp.num_tiles == (tiles,)
    ref = _hf_projected(hf_tiny, inp)  # [1, 4, 17, 64]
    with torch.no_grad():
        full = ours.multi_modal_projector(ours.vision_model(
            inp.pixel_values, inp.aspect_ratio_ids, inp.aspect_ratio_mask))
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        (enc,) = ours.encode([inp])
    assert enc.shape == (tiles * 17, 64) == (ours.encoder_len(inp), 64)
    torch.testing.assert_close(enc, ref[0, :tiles].reshape(-1, 64), atol=1e-5, rtol=1e-5)


def test_encode_batches_requests(ours, hf_tiny):
    cfg = MllamaImageConfig(image_size=56)
    a = preprocess_images([synthetic_image(100, 50, 1), synthetic_image(300, 40, 2)], cfg)
    b = preprocess_images([synthetic_image(50, 100, 3)], cfg)
    with torch.no_grad():
        outs = ours.encode([a, None, b])
    assert [o.shape[0] for o in outs] == [6 * 17, 0, 2 * 17]
    for inp, enc in ((a, outs[0]), (b, outs[2])):
        ref = _hf_projected(hf_tiny, inp)
        want = torch.cat([ref[i, :t].reshape(-1, 64) for i, t in enumerate(inp.num_tiles)])
        torch.testing.assert_close(enc, want, atol=1e-5, rtol=1e-5)


def test_meta_intermediate_semantics(tiny_folder, hf_tiny):
    """Meta index i (input of layer i) equals HF-5.24 index i - 1 (output of layer i - 1)."""
    meta = load_mllama(tiny_folder, vision_intermediate_semantics="meta")
    inp = preprocess_images([synthetic_image(100, 50)], MllamaImageConfig(image_size=56))
    vm = hf_tiny.model.vision_model
    with torch.no_grad():
        D = 32
        ours = meta.vision_model(inp.pixel_values, inp.aspect_ratio_ids, inp.aspect_ratio_mask)
        # Meta index 1 = input of layer 1 = HF output of layer 0 (HF index 0).
        vm.intermediate_layers_indices = [0, 0]
        try:
            ref = vm(pixel_values=inp.pixel_values[None],
                     aspect_ratio_ids=inp.aspect_ratio_ids[None],
                     aspect_ratio_mask=inp.aspect_ratio_mask[None]).last_hidden_state[0]
        finally:
            vm.intermediate_layers_indices = [0, 1]
    torch.testing.assert_close(ours[..., :D], ref[..., :D], atol=1e-5, rtol=1e-5)
    # channel D + d*K + k: k = 1 is Meta index 1 -> HF index 0
    torch.testing.assert_close(ours[..., D + 1::2], ref[..., D + 1::2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[..., D::2], ref[..., D::2], atol=1e-3)  # index 0 differs


# (semantics, intermediate layers) -> (adds delta, gated) of every add_layer_norm call
FUSED_CASES = {
    ("hf", (1, 1)): [(False, False), (True, False),  # local 0
                     (True, False), (True, False),  # local 1: its input add fused; then saved
                     (False, False),  # layernorm_post: nothing pending
                     (False, False), (True, True), (True, True), (True, True)],  # global 0, 1
    ("meta", (0, 1)): [(False, False), (True, False),  # local 0 (its input saved)
                       (False, False), (True, False),  # local 1 (its input saved: added)
                       (True, False),  # layernorm_post adds local 1's MLP output
                       (False, False), (True, True), (True, True), (True, True)],
}


@pytest.mark.parametrize("semantics,saved", list(FUSED_CASES), ids=str)
def test_fused_add_norm_kernel_gives_the_eager_features(tiny_folder, semantics, saved):
    """The vision encoder with the Triton add + LayerNorm (interpreter on CPU, CUDA where there
    is one) vs its torch ops: every add fused into the next norm (tanh-gated in the global
    layers, one more global layer so a gated add reaches the next layer's norm), pending adds
    flushed where a feature is saved; the features and the output within fp32 rounding."""
    import copy
    import dataclasses

    from edserve.layers.add_norm import TRITON_ADD_NORM, AddNormOps

    pytest.importorskip("triton")
    vm = load_mllama(tiny_folder, vision_intermediate_semantics=semantics).vision_model
    vm.cfg = dataclasses.replace(vm.cfg, intermediate_layers_indices=saved)
    vm.global_transformer.layers.append(copy.deepcopy(vm.global_transformer.layers[0]))
    with torch.no_grad():
        vm.global_transformer.layers[1].gate_ffn.fill_(-0.7)
    calls = []

    def counted(norm, x, delta=None, gate=None):
        calls.append((delta is not None, gate is not None))
        return TRITON_ADD_NORM.add_layer_norm(norm, x, delta, gate)

    inp = preprocess_images([synthetic_image(*SIZES[2], seed=5)], MllamaImageConfig(image_size=56))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA tensors there
    vm.to(dev)
    args = (inp.pixel_values.to(dev), inp.aspect_ratio_ids.to(dev), inp.aspect_ratio_mask)
    with torch.inference_mode():
        ref = vm(*args)
        vm.add_norm = AddNormOps("counted", counted)
        got = vm(*args)
    assert calls == FUSED_CASES[semantics, saved]
    assert got.shape == ref.shape == (1, 4, 17, 96)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_add_norm_matches_torch_ops(tiny_folder):
    """On CUDA the vision encoder picks the Triton add + LayerNorm; bf16 features within bf16
    rounding of the separate torch ops (fp32: 1e-5)."""
    from edserve.layers.add_norm import TORCH_ADD_NORM, add_norm_ops

    with torch.inference_mode():
        assert add_norm_ops(torch.zeros(1, device="cuda")).name == "triton"
    inp = preprocess_images([synthetic_image(*SIZES[4], seed=6)], MllamaImageConfig(image_size=56))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        vm = load_mllama(tiny_folder, dtype=dtype, device="cuda").vision_model
        args = (inp.pixel_values.cuda(), inp.aspect_ratio_ids.cuda(), inp.aspect_ratio_mask)
        with torch.inference_mode():
            got = vm(*args)
            vm.add_norm = TORCH_ADD_NORM
            ref = vm(*args)
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
