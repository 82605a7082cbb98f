"""The HF transformers side of ``mllama_gpu.py``: configs, the random-weight model, and batched
``generate`` / vision runs on the same requests the engine gets.

The model is built once, in its final dtype directly on the device (no float32 CPU copy of
11 B parameters); its ``state_dict()`` (HF names) is what the engine loads.
"""

from __future__ import annotations

import time

import torch

BOS = 1  # the image token is vocab_size
SIZES = {
    # Llama-3.2-11B-Vision (config.json of the published checkpoint)
    "11b": dict(vocab=128256, hidden=4096, inter=14336, layers=40, heads=32, kv=8,
                cross=[3, 8, 13, 18, 23, 28, 33, 38], v_hidden=1280, v_heads=16, v_inter=5120,
                v_layers=32, v_global=8, image=560, v_idx=[3, 7, 15, 23, 30]),
    # 11B widths, 8 text layers (2 cross) and 4 + 1 vision layers: ~3 B parameters
    "small": dict(vocab=128256, hidden=4096, inter=14336, layers=8, heads=32, kv=8,
                  cross=[3, 7], v_hidden=1280, v_heads=16, v_inter=5120, v_layers=4,
                  v_global=1, image=560, v_idx=[1, 3]),
    "toy": dict(vocab=128, hidden=64, inter=128, layers=4, heads=4, kv=2, cross=[2],
                v_hidden=32, v_heads=4, v_inter=64, v_layers=2, v_global=1, image=56,
                v_idx=[0, 1]),
}


def hf_config(d: dict) -> dict:
    text = dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                num_key_value_heads=d["kv"], cross_attention_layers=d["cross"],
                rms_norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=BOS,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
    vision = dict(hidden_size=d["v_hidden"], attention_heads=d["v_heads"],
                  intermediate_size=d["v_inter"], num_hidden_layers=d["v_layers"],
                  num_global_layers=d["v_global"], image_size=d["image"], patch_size=14,
                  max_num_tiles=4, intermediate_layers_indices=d["v_idx"],
                  vision_output_dim=d["v_hidden"] * (1 + len(d["v_idx"])), norm_eps=1e-5)
    return dict(model_type="mllama", image_token_index=d["vocab"], text_config=text,
                vision_config=vision)


@torch.no_grad()
def fill_random(module: torch.nn.Module, device: str) -> None:
    """Give the parameters HF initializes to zero random values (seeded): tanh gates in
    0.5..1.5 (open: zero gates would hide the cross-attention and global layers), the rest
    normal with 1/sqrt(fan-in)."""
    gen = torch.Generator(device=device).manual_seed(1)
    for name, p in module.named_parameters():
        if "gate" in name and p.numel() == 1:
            p.copy_(torch.rand(1, generator=gen, device=device) + 0.5)
        elif not p.any():
            p.normal_(0, p.shape[-1] ** -0.5, generator=gen)


@torch.no_grad()
def build_hf(config: dict, device: str, dtype: torch.dtype):
    """``MllamaForConditionalGeneration`` with HF's init (seed 0) built in ``dtype`` on
    ``device``; scalar gates U(0.5, 1.5) and all-zero tensors N(0, in^-0.5) (seed 1), so the
    cross-attention and tile embeddings are not no-ops."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(0)
    cfg = MllamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MllamaForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    # Forced length without suppressing EOS (the engine's ignore_eos samples it like any token)
    model.generation_config.eos_token_id = None
    for p in model.parameters():  # float32 buffers HF creates explicitly (RoPE) stay float32
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    fill_random(model, device)
    return model


@torch.no_grad()
def share_weights(hf, model) -> int:
    """Point every HF parameter at the engine model's copy (fused projections: their rows), so
    the two models hold one set of weights; returns the bytes freed. The engine's tensors keep
    their addresses (its CUDA graphs read them); HF runs eagerly."""
    from torch import nn

    from edserve.models.mllama.weights import hf_to_edserve_name
    from edserve.models.weights.fused import hf_slots

    params = dict(model.named_parameters())
    slots, _ = hf_slots(model)
    freed = 0
    for name, p in list(hf.named_parameters()):
        pname, a, b = slots[hf_to_edserve_name(name)]
        target = params[pname][a:b] if params[pname].dim() else params[pname]
        if target.shape != p.shape or target.dtype != p.dtype or target.device != p.device:
            raise ValueError(f"{name}: {tuple(p.shape)} {p.dtype} cannot share {pname}")
        if target.data_ptr() != p.data_ptr():
            freed += p.numel() * p.element_size()
        owner, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(owner), attr, nn.Parameter(target, requires_grad=False))
    return freed


def batch_inputs(model, case_list, device: str) -> dict:
    """Left-padded ``generate`` inputs for (prompt ids, MllamaImageInput | None) pairs:
    text-only rows get zero pixels and an all-zero cross-attention mask (HF's processor)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    vc = model.config.vision_config
    T, S = vc.max_num_tiles, vc.image_size
    B, L = len(case_list), max(len(p) for p, _ in case_list)
    ids = torch.zeros(B, L, dtype=torch.int64)
    att = torch.zeros(B, L, dtype=torch.int64)
    pix = torch.zeros(B, 1, T, 3, S, S)
    ar_ids = torch.zeros(B, 1, dtype=torch.int64)
    ar_mask = torch.zeros(B, 1, T, dtype=torch.int64)
    ar_mask[:, :, 0] = 1
    cross = torch.zeros(B, L, 1, T, dtype=torch.int64)
    image_token = model.config.image_token_index
    for b, (prompt, image) in enumerate(case_list):
        n = len(prompt)
        ids[b, L - n:] = torch.tensor(prompt)
        att[b, L - n:] = 1
        if image is None:
            continue
        if image.num_images != 1:
            raise ValueError("the benchmark's HF batches hold one image per request")
        pix[b] = image.pixel_values
        ar_ids[b] = image.aspect_ratio_ids
        ar_mask[b] = image.aspect_ratio_mask
        sparse = get_cross_attention_token_mask(prompt, image_token)
        dense = convert_sparse_cross_attention_mask_to_dense([sparse], [list(image.num_tiles)],
                                                             T, n)
        cross[b, L - n:] = torch.from_numpy(dense)[0]
    dt = model.dtype
    return dict(input_ids=ids.to(device), attention_mask=att.to(device),
                pixel_values=pix.to(device, dt), aspect_ratio_ids=ar_ids.to(device),
                aspect_ratio_mask=ar_mask.to(device), cross_attention_mask=cross.to(device))


@torch.inference_mode()
def hf_generate(model, inputs: dict, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy, exactly ``new_tokens`` per row; (tokens per row, seconds)."""
    sync(str(model.device))
    t0 = time.perf_counter()
    out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=0)
    sync(str(model.device))
    dt = time.perf_counter() - t0
    return out[:, inputs["input_ids"].shape[1]:].tolist(), dt


def hf_generate_fitting(model, inputs: dict, new_tokens: int
                        ) -> tuple[list[list[int]], float, int]:
    """:func:`hf_generate` on the whole batch, or, when HF runs out of GPU memory, on chunks
    of half the size (then a quarter, ...) run one after another: (tokens, seconds, chunk)."""
    B = inputs["input_ids"].shape[0]
    chunk = B
    while True:
        try:
            tokens, seconds = [], 0.0
            for i in range(0, B, chunk):
                part = {k: v[i:i + chunk] for k, v in inputs.items()}
                t, s = hf_generate(model, part, new_tokens)
                tokens += t
                seconds += s
            return tokens, seconds, chunk
        except torch.cuda.OutOfMemoryError:
            if chunk == 1:
                raise
        chunk = (chunk + 1) // 2  # outside the except block: its frames hold the memory
        torch.cuda.empty_cache()


@torch.inference_mode()
def hf_vision_seconds(model, inputs: dict) -> float:
    """Vision encoder + projector over the batch's images (every row's 4 tile slots)."""
    sync(str(model.device))
    t0 = time.perf_counter()
    m = getattr(model, "model", model)  # transformers 5: .model holds the vision tower
    states = m.vision_model(pixel_values=inputs["pixel_values"],
                            aspect_ratio_ids=inputs["aspect_ratio_ids"],
                            aspect_ratio_mask=inputs["aspect_ratio_mask"])
    states = states[0] if isinstance(states, tuple) else states.last_hidden_state
    m.multi_modal_projector(states)
    sync(str(model.device))
    return time.perf_counter() - t0


def set_dense_tiles(spec: str | None) -> None:
    """``--dense-tiles BM,BN,WARPS,STAGES``: the Triton vision attention's launch shape for this
    process (e.g. the best of ``attn_headdim.py``'s sweep); None keeps the default."""
    if not spec:
        return
    from edserve.kernels import dense_attention as da

    bm, bn, w, st = (int(x) for x in spec.split(","))
    da.DEFAULT_TILES = da.DenseTiles(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    print(f"# dense attention tiles {da.DEFAULT_TILES}", flush=True)


def fresh_cache(cuda: bool) -> None:
    """Return the caching allocator's unused blocks and reset the peak (both systems share one
    GPU and process: each timed system starts with all free memory available to it)."""
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def alloc_retries(cuda: bool) -> int:
    """The caching allocator's retries so far (a cudaMalloc that failed, blocks freed, tried
    again: a run near the memory limit pays for it)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
