"""Mllama vision encoder + projector alone: edserve's attention plans vs HF, ms per image.

Random weights (HF's init, gates U(0.5, 1.5), zero tensors N(0, in^-0.5)) in HF
``MllamaVisionModel``; edserve's vision model loads the same weights. For each tile count
1..4, a batch of ``--images`` images of that many tiles, then a mixed batch (4, 1, 2, 3, ...
tiles): median wall time of ``--runs`` runs after a warm-up, per image and per real tile, for
edserve's "grouped" (mask-free, SDPA) and "masked" (HF's mask) attention plans, "triton" (grouped
on the Triton dense-attention kernel, the engine's default on CUDA), "tma" (grouped on the
TMA-fed Triton kernel; Hopper+), "unfused" (grouped,
the residual adds and LayerNorms as separate torch ops, not the fused Triton add + LayerNorm)
and HF (which always runs and projects all 4 tile slots). On the mixed batch it also times
the grouped plan with each SDPA backend alone (CUDA) and prints the largest difference of the
kept tiles' projected states between the plans and against HF.

  python benchmarks/mllama_vision.py                 # H200, 11B vision tower: ~1 minute
  python benchmarks/mllama_vision.py --dry-run       # toy sizes on CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mllama_hf import SIZES, fill_random, hf_config, set_dense_tiles, sync  # noqa: E402


@torch.no_grad()
def build(d: dict, device: str, dtype: torch.dtype):
    """(HF vision model, edserve vision model, projector): one set of random weights."""
    from transformers import MllamaVisionConfig as HFVisionConfig
    from transformers.models.mllama.modeling_mllama import MllamaVisionModel as HFVision

    from edserve.models.mllama.config import MllamaVisionConfig
    from edserve.models.mllama.vision import MllamaVisionModel
    from edserve.models.weights.fused import load_hf_tensors

    vd = hf_config(d)["vision_config"]
    torch.manual_seed(0)
    hcfg = HFVisionConfig(**vd)
    hcfg._attn_implementation = "sdpa"
    with torch.device(device):
        hf = HFVision(hcfg).to(dtype).eval()
        proj = torch.nn.Linear(vd["vision_output_dim"], d["hidden"]).to(dtype)
    fill_random(hf, device)
    with torch.device(device):
        ours = MllamaVisionModel(MllamaVisionConfig.from_hf(vd)).to(dtype).eval()
    load_hf_tensors(ours, dict(hf.named_parameters()))
    return hf, ours, proj


def batch(n: int, tiles: list[int], image: int, device: str, dtype: torch.dtype, seed: int):
    """``n`` images cycling through ``tiles``: pixel values (zero padding tiles), aspect-ratio
    ids and masks (host), flat (image, tile) indices of the valid tiles."""
    from edserve.multimodal.mllama_image import supported_aspect_ratios

    g = torch.Generator().manual_seed(seed)
    counts = [tiles[i % len(tiles)] for i in range(n)]
    ratios = supported_aspect_ratios(4)
    pv = torch.zeros(n, 4, 3, image, image)
    mask = torch.zeros(n, 4, dtype=torch.int64)
    ids = torch.tensor([ratios.index((1, t)) + 1 for t in counts])  # 1 x t tiles
    for i, t in enumerate(counts):
        pv[i, :t] = torch.randn(t, 3, image, image, generator=g)
        mask[i, :t] = 1
    keep = [i * 4 + k for i, t in enumerate(counts) for k in range(t)]
    return pv.to(device, dtype), ids.to(device), mask, keep


@torch.inference_mode()  # as the engine runs it (the fused add + LayerNorm: no autograd)
def run_ours(ours, proj, plan: str, b, add_norm=None, gelu: str = "exact",
             kernel: str = "sdpa") -> torch.Tensor:
    """``add_norm``: the encoder's add + LayerNorm ops (None: by device, the engine's);
    ``gelu``: ``--encoder-gelu`` (exact, or tanh: cuBLASLt's bias + GELU epilogue on CUDA);
    ``kernel``: the grouped plan's attention kernel (sdpa, or triton: ours at head dim 80)."""
    from edserve.layers.linear_gelu import set_linear_gelu

    pv, ids, mask, keep = b
    ours.attention_plan, ours.add_norm, ours.attention_kernel = plan, add_norm, kernel
    set_linear_gelu(ours, gelu)
    return proj(ours(pv, ids, mask, tiles=keep))  # [kept tiles, P, hidden]


@torch.inference_mode()
def run_hf(hf, proj, b) -> torch.Tensor:
    pv, ids, mask, keep = b
    dev = pv.device
    out = hf(pixel_values=pv[None], aspect_ratio_ids=ids[None],
             aspect_ratio_mask=mask.to(dev)[None]).last_hidden_state
    return proj(out[0]).flatten(0, 1)[torch.tensor(keep, device=dev)]  # projects all 4 slots


def timed(fn, runs: int, device: str) -> float:
    """Median seconds of ``runs`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_table(fn, b, device: str, top: int = 18) -> None:
    """Where one batch's device time goes: the kernels (CUDA; CPU ops on the CPU) with the
    most self time, with their share and calls."""
    from torch.profiler import ProfilerActivity, profile

    fn(b)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn(b)
        sync(device)
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if device == "cuda":  # kernels only (ops' own device time double-counts them)
        events = [e for e in events if e.device_type.name == "CUDA"]
    total = sum(getattr(e, attr) for e in events)
    print(f"# kernel table, grouped plan, {len(b[3])} tiles: {total / 1000:.2f} ms of "
          f"{'device' if device == 'cuda' else 'CPU'} time", flush=True)
    print("| kernel | calls | ms | share |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:top]:
        t = getattr(e, attr)
        print(f"| `{e.key[:90]}` | {e.count} | {t / 1000:.3f} | {100 * t / total:.1f} % |")


def sdpa_backends(fn, b, args) -> None:
    """The grouped plan on the mixed batch with each SDPA backend alone (which one SDPA picks
    by default, and whether it is the fastest)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                s = timed(lambda: fn(b), args.runs, "cuda")
            row.append(f"{name.split('_')[0].lower()} {1000 * s / args.images:7.2f} ms/img")
        except (RuntimeError, AttributeError) as e:  # backend unavailable for these inputs
            row.append(f"{name.split('_')[0].lower()} n/a ({str(e).splitlines()[0][:60]})")
    print("# grouped plan, mixed batch, one SDPA backend each: " + " | ".join(row), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="11b", choices=("small", "11b"))
    ap.add_argument("--images", type=int, default=8, help="images per batch")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip HF's vision model")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (fp32)")
    ap.add_argument("--profile", action="store_true",
                    help="also a kernel table (torch profiler) of the grouped plan on a batch "
                    "of 4-tile images")
    ap.add_argument("--dense-tiles", default=None, help="BM,BN,WARPS,STAGES of the Triton "
                    "vision attention (default: the kernel's DEFAULT_TILES)")
    ap.add_argument("--shapes", default="1,2,3,4,mixed",
                    help="batches to time: tile counts 1-4 and/or 'mixed'")
    args = ap.parse_args(argv)
    from edserve.layers.add_norm import TORCH_ADD_NORM

    set_dense_tiles(args.dense_tiles)
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.images, args.runs, d = 3, 1, SIZES["toy"]
    else:
        d = SIZES[args.size]
        if not torch.cuda.is_available():
            print("no CUDA device; use --dry-run")
            return 2
    hf, ours, proj = build(d, device, dtype)
    runners = {"grouped": lambda b: run_ours(ours, proj, "grouped", b),
               "masked": lambda b: run_ours(ours, proj, "masked", b),
               "unfused": lambda b: run_ours(ours, proj, "grouped", b, TORCH_ADD_NORM),
               "tanh": lambda b: run_ours(ours, proj, "grouped", b, gelu="tanh"),
               "triton": lambda b: run_ours(ours, proj, "grouped", b, kernel="triton")}
    if device == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        runners["tma"] = lambda b: run_ours(ours, proj, "grouped", b, kernel="tma")
    if os.environ.get("EDSERVE_FA3_LIB"):  # FlashAttention-3 (tools/build_fa3.sh)
        runners["fa3"] = lambda b: run_ours(ours, proj, "grouped", b, kernel="fa3")
    if not args.no_hf:
        runners["hf"] = lambda b: run_hf(hf, proj, b)
    print(f"# vision {'toy' if args.dry_run else args.size} on {device} {dtype}, "
          f"{args.images} images per batch, median of {args.runs}", flush=True)
    shapes = [[4, 1, 2, 3] if x == "mixed" else [int(x)] for x in args.shapes.split(",")]
    for tiles in shapes:
        b = batch(args.images, tiles, d["image"], device, dtype, seed=len(tiles) + tiles[0])
        n_tiles = len(b[3])
        row = []
        for name, fn in runners.items():
            s = timed(lambda fn=fn, b=b: fn(b), args.runs, device)
            row.append(f"{name} {1000 * s / args.images:7.2f} ms/img "
                       f"{1000 * s / n_tiles:6.2f} ms/tile")
        label = "mixed 4,1,2,3" if len(tiles) > 1 else f"{tiles[0]} tile{'s' * (tiles[0] > 1)}"
        print(f"{label:>14}: " + " | ".join(row), flush=True)
    if args.profile:
        kernel_table(runners["grouped"], batch(args.images, [4], d["image"], device, dtype, 7),
                     device)
    if device == "cuda":
        sdpa_backends(runners["grouped"], b, args)
    outs = {name: fn(b).float() for name, fn in runners.items()}  # the mixed batch
    ref = outs["masked"]
    scale = ref.abs().max().item()
    diffs = ", ".join(f"{name} {(o - ref).abs().max().item():.3g}" for name, o in outs.items()
                      if name != "masked")
    print(f"# mixed batch, max |x - masked| (max |masked| {scale:.3g}): {diffs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
