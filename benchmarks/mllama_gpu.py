"""Mllama (Llama-3.2-Vision) on one GPU with random weights: strategy agreement, parity with a CPU
fp32 reference, and mixed image/text batch throughput.

Model: 11B-like widths scaled in depth (text 4096 hidden, 32 q / 8 kv heads, head_dim 128,
SwiGLU 14336, 8 layers of which 2 are cross-attention; vision 1280 hidden, 4 local + 1 global
layers, 560 px tiles -> 1601 keys per tile, 4 tiles). bf16 on CUDA with the Triton kernels.

1. Correctness: a few requests (2- and 4-tile images, text before an image, text-only), greedy
   with EOS ignored, through each strategy (aligned/128, ragged/1, flat/1): the tokens must agree
   across strategies, and the logits (captured by a logits processor) must be close to a CPU fp32
   run with the torch ops on the same (bf16-rounded) weights, step by step while the tokens agree.
2. Throughput: a mixed batch (default 16 image requests of 1-4 tiles + 16 text-only, 64 new
   tokens) per strategy: requests/s, generated tokens/s, peak GPU memory.

Triton ops without per-query key ranges (``supports_kv_ranges`` False) cannot run image
requests (their cross-attention needs the ranges); the strategy then runs on the torch ops and
the script says so. The ragged strategy's varlen call always uses the torch ops for ranged
(cross-attention) queries.

  python benchmarks/mllama_gpu.py               # H200: < 4 minutes
  python benchmarks/mllama_gpu.py --dry-run     # toy sizes on CPU, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BOS = 1  # the image token is vocab_size
DIMS = {
    "bench": dict(vocab=128256, hidden=4096, inter=14336, layers=8, heads=32, kv=8, cross=[3, 7],
                  v_hidden=1280, v_heads=16, v_inter=5120, v_layers=4, v_global=1, image=560,
                  v_idx=[1, 3]),
    "toy": dict(vocab=128, hidden=64, inter=128, layers=4, heads=4, kv=2, cross=[2],
                v_hidden=32, v_heads=4, v_inter=64, v_layers=2, v_global=1, image=56,
                v_idx=[0, 1]),
}
STRATEGIES = [("aligned", 128), ("ragged", 1), ("flat", 1)]
TILE_SHAPES = {1: (400, 300), 2: (800, 400), 3: (1200, 400), 4: (1000, 1000)}  # (W, H) at 560


def hf_config(d: dict) -> dict:
    text = dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                num_key_value_heads=d["kv"], cross_attention_layers=d["cross"],
                rms_norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=BOS,
                eos_token_id=2, pad_token_id=0,
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


def random_state_dict(config: dict, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Default module init (seed 0); gates U(0.5, 1.5) and zero-initialised embeddings
    N(0, hidden^-0.5), so cross-attention and tile embeddings are not no-ops."""
    from edserve.models.mllama import MllamaConfig, MllamaModel

    torch.manual_seed(0)
    with torch.device(device):
        model = MllamaModel(MllamaConfig.from_hf(config))
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.copy_(torch.rand(1, generator=gen, device=device) + 0.5)
            elif not p.any():
                p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    del model
    return sd


def make_engine(config: dict, sd: dict, device: str, dtype: str, strategy: str, page: int,
                ops: str, rows: int, new_tokens: int):
    from edserve.models.weights import Checkpoint
    from edserve.runtime import build_engine

    ckpt = Checkpoint(Path("<random mllama>"), "hf", config, sd, Path("/nonexistent"))
    p = config["vision_config"]
    enc = 4 * ((p["image_size"] // 14) ** 2 + 1)  # one 4-tile image
    per_req = -(-(enc + page + 64 + new_tokens + 2 * page) // page) * page
    return build_engine(checkpoint=ckpt, device=device, dtype=dtype, encoder_kv=strategy,
                  page_size=str(page), attention_backend=ops, max_running_requests=rows,
                  max_total_tokens=rows * per_req + 4096, context_length=256,
                  max_new_tokens=new_tokens)


def synthetic(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1),
                    rng.integers(0, 256, (height, width))], -1).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def cases(vocab: int, image_px: int, n_img: int, n_text: int, seed: int = 0) -> list:
    """(prompt ids, images): images of 1-4 tiles (cycling) first, then text-only prompts."""
    rng = np.random.default_rng(seed)
    scale = image_px / 560
    out = []
    for i in range(n_img):
        w, h = TILE_SHAPES[i % 4 + 1]
        img = synthetic(max(1, int(w * scale)), max(1, int(h * scale)), seed + i)
        words = rng.integers(8, vocab, 12 + i % 5).tolist()
        prompt = [vocab, BOS] + words if i % 3 else [BOS] + words[:3] + [vocab] + words[3:]
        out.append((prompt, [img]))
    for i in range(n_text):
        out.append(([BOS] + rng.integers(8, vocab, 10 + i % 7).tolist(), []))
    return out


def run(engine, case_list, steps: int, capture: bool):
    """Greedy, EOS ignored; returns (token lists, per-request [steps, vocab] logits or None,
    seconds in ``generate``: image preprocessing is done before the clock starts)."""
    from edserve.chat.mllama_request import make_mllama_request
    from edserve.engine.logits_filter import LogitsRecorder
    from edserve.engine.request import SamplingParams

    sp = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    recorders = [LogitsRecorder() for _ in case_list]
    reqs = []
    for i, (prompt, images) in enumerate(case_list):
        r = make_mllama_request(engine.model, prompt, images, sp)
        if capture:
            r.logits_processors.append(recorders[i])
        reqs.append(r)
    sync(str(engine.device))
    t = time.perf_counter()
    outs = engine.generate(reqs)
    sync(str(engine.device))
    dt = time.perf_counter() - t
    engine.check_integrity()
    logs = [[x.float().cpu() for x in r.rows] for r in recorders]
    return [o.token_ids for o in outs], [torch.stack(x) if x else None for x in logs], dt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def choose_ops(device: str, requested: str) -> str:
    if requested == "torch" or (requested == "auto" and not device.startswith("cuda")):
        return "torch"
    from edserve.layers.attention.ops import get_ops

    if get_ops("triton").supports_kv_ranges:
        return "triton"
    print("note: the Triton ops lack per-query kv ranges (supports_kv_ranges False); every "
          "strategy runs on the torch ops")
    return "torch"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU")
    ap.add_argument("--image-requests", type=int, default=16)
    ap.add_argument("--text-requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--check-steps", type=int, default=8)
    ap.add_argument("--ops", default="auto", choices=("auto", "torch", "triton"),
                    help="attention ops on the device (auto: triton on CUDA, torch on CPU; "
                    "triton on CPU needs TRITON_INTERPRET=1)")
    ap.add_argument("--tol", type=float, default=0.05,
                    help="max |logit diff| / max |ref logit| allowed vs the CPU fp32 reference")
    args = ap.parse_args()
    dims = DIMS["toy" if args.dry_run else "bench"]
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run")
        return 2
    config = hf_config(dims)
    ops = choose_ops(device, args.ops)
    t0 = time.perf_counter()
    sd = random_state_dict(config, device, torch.bfloat16)
    print(f"random weights: {sum(v.numel() for v in sd.values()) / 1e9:.2f} B params "
          f"({time.perf_counter() - t0:.1f} s); ops={ops}, device={device}")

    # --- 1. correctness --------------------------------------------------------------------
    check = [cases(dims["vocab"], dims["image"], 4, 1)[i] for i in (1, 2, 3, 4)]  # 2,3,4 tiles
    steps = args.check_steps
    t = time.perf_counter()
    ref_sd = {k: v.to("cpu", torch.float32) for k, v in sd.items()}
    ref_engine = make_engine(config, ref_sd, "cpu", "float32", "flat", 1, "torch", 4, steps)
    del ref_sd
    ref_tokens, ref_logits, _ = run(ref_engine, check, steps, capture=True)
    del ref_engine
    gc.collect()
    print(f"CPU fp32 reference: {len(check)} requests x {steps} steps "
          f"({time.perf_counter() - t:.1f} s)")
    ok, tokens_by = True, {}
    for strategy, page in STRATEGIES:
        eng = make_engine(config, sd, device, "bfloat16", strategy, page, ops, 4, steps)
        toks, logits, _ = run(eng, check, steps, capture=True)
        tokens_by[strategy] = toks
        worst = 0.0
        for i, (a, b) in enumerate(zip(toks, ref_tokens, strict=True)):
            same = next((k for k in range(steps) if a[k] != b[k]), steps)
            if same < steps:
                print(f"  {strategy}: request {i} leaves the reference path at step {same}")
            for k in range(min(same + 1, steps)):  # logits are comparable up to the split
                ref = ref_logits[i][k]
                worst = max(worst, float((logits[i][k] - ref).abs().max() / ref.abs().max()))
        print(f"{strategy}/{page}: max rel logit error vs CPU fp32 = {worst:.4f}")
        ok &= worst <= args.tol
        del eng
        gc.collect()
    agree = all(v == tokens_by["flat"] for v in tokens_by.values())
    print(f"strategies agree on greedy tokens: {agree}")
    ok &= agree

    # --- 2. throughput ---------------------------------------------------------------------
    mixed = cases(dims["vocab"], dims["image"], args.image_requests, args.text_requests, 7)
    rows = len(mixed)
    tiles = sum(i % 4 + 1 for i in range(args.image_requests))
    print(f"mixed batch: {args.image_requests} image requests ({tiles} tiles) + "
          f"{args.text_requests} text-only, {args.new_tokens} new tokens each")
    for strategy, page in STRATEGIES:
        eng = make_engine(config, sd, device, "bfloat16", strategy, page, ops, rows,
                          args.new_tokens)
        run(eng, mixed[:2] + mixed[-2:], 4, capture=False)  # warm-up (kernels, allocator)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        toks, _, dt = run(eng, mixed, args.new_tokens, capture=False)
        n_tok = sum(len(x) for x in toks)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        print(f"{strategy}/{page} [{ops}]: {rows / dt:.2f} requests/s, {n_tok / dt:.0f} "
              f"tokens/s, {dt:.2f} s, peak memory {peak:.1f} GiB")
        del eng
        gc.collect()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
