"""Mllama (Llama-3.2-Vision) on one GPU with random weights: edserve vs HF transformers.

One process, one set of random bf16 weights built with HF ``MllamaForConditionalGeneration``
directly on the GPU (``--size 11b``: Llama-3.2-11B-Vision's real config; ``small``: 11B widths,
8 text + 5 vision layers) and loaded by the engine. Batches of image requests (one image each,
1-4 tiles of 560 px, prompts that start with ``<|image|>``) plus text-only rows; greedy, forced
length (HF: no EOS and ``min_new_tokens = max_new_tokens``; edserve: ``ignore_eos``). For every
strategy and batch, HF ``generate`` and edserve run alternately on the same requests (each
first once untimed at the batch's shapes; ``--repeats`` timed runs, the median counts), and the
script prints:
  requests/s, tokens/s, ratio to HF, the timed run's engine steps by kind, time to first token
  (a 1-token run of the whole batch), vision encoder + projector ms per tile, decode ms per
  step with every request running, synced and back to back (``mllama_steps.py``), vs the
  floor (text weights + self/cross KV read once per step / measured copy bandwidth), peak
  memory, GPU busy share of decode steps (torch profiler), syncs per decode step
  (``torch.cuda.set_sync_debug_mode``), and greedy-token agreement with HF (whole requests).
HF's text-only rows in a mixed batch attend to a dummy image (mllama-facts.md section 5), so
their agreement is reported apart from the image rows'.

  python benchmarks/mllama_gpu.py --size 11b --json /tmp/mllama_11b.json  # H200: ~5 minutes
  python benchmarks/mllama_gpu.py --size small
  python benchmarks/mllama_gpu.py --dry-run     # toy sizes on CPU, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: A/B trees

from mllama_hf import (  # noqa: E402
    BOS,
    SIZES,
    alloc_retries,
    batch_inputs,
    build_hf,
    fresh_cache,
    hf_config,
    hf_generate_fitting,
    hf_vision_seconds,
    set_dense_tiles,
    share_weights,
)
from mllama_steps import (  # noqa: E402
    decode_stats,
    engine_vision_seconds,
    floor_ms,
    profile_step,
    run_edserve,
    text_weight_bytes,
)
from whisper_gpu import ceilings  # noqa: E402

TILE_SHAPES = {1: (400, 300), 2: (800, 400), 3: (1200, 400), 4: (1000, 1000)}  # (W, H) at 560


def synthetic(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1),
                    rng.integers(0, 256, (height, width))], -1).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def cases(d: dict, n_img: int, n_text: int, seed: int = 0) -> list:
    """(prompt ids, PIL images): image requests of 4, 1, 2, 3, 4, ... tiles (image first, so
    every row sees its image: exact in HF and edserve), then text-only prompts."""
    rng = np.random.default_rng(seed)
    scale, vocab = d["image"] / 560, d["vocab"]
    out = []
    for i in range(n_img):
        w, h = TILE_SHAPES[(i + 3) % 4 + 1]
        img = synthetic(max(1, int(w * scale)), max(1, int(h * scale)), seed + i)
        out.append(([vocab, BOS] + rng.integers(8, vocab, 12 + i % 5).tolist(), [img]))
    for i in range(n_text):
        out.append(([BOS] + rng.integers(8, vocab, 10 + i % 7).tolist(), []))
    return out


def make_engine(config: dict, hf, args, strategy: str, page: int, pre: list,
                graph: bool = True, mixed: bool = True, vision_kernel: str = "auto"):
    """An engine whose KV pool holds the requests ``pre`` (prompt, preprocessed image or
    None) once, plus slack; CUDA graphs up to their number; ``mixed``: mixed steps;
    ``vision_kernel``: the vision tower's attention kernel (auto: Triton on CUDA, fed by TMA
    descriptors on Hopper)."""
    from edserve.models.weights import Checkpoint
    from edserve.runtime import build_engine

    ckpt = Checkpoint(Path("<random mllama>"), "hf", config, dict(hf.state_dict()),
                      Path("/nonexistent"))
    P = (config["vision_config"]["image_size"] // 14) ** 2 + 1
    need = 0
    for prompt, image in pre:
        enc = -(-P * sum(image.num_tiles) // page) * page if image is not None else 0
        need += -(-(enc + len(prompt) + args.new_tokens + 2 * page) // page) * page
    rows = len(pre)
    engine = build_engine(checkpoint=ckpt, device=args.device, dtype=args.dtype_name,
                        encoder_kv=strategy, page_size=str(page), attention_backend=args.ops,
                        max_running_requests=rows, max_total_tokens=need + 64 * page + 8192,
                        context_length=64 + args.new_tokens, max_new_tokens=args.new_tokens,
                        cuda_graph=graph and args.device == "cuda" and strategy != "ragged",
                        cuda_graph_max_bs=rows, mixed_steps=mixed)
    share_weights(hf, engine.model)  # one copy of the weights for both (fits 11b twice over)
    engine.model.vision_model.attention_kernel = vision_kernel
    return engine


def agreement(ours: list[list[int]], hf: list[list[int]], n_img: int) -> dict:
    same = [a == b for a, b in zip(ours, hf, strict=True)]
    prefix = [next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
              for a, b in zip(ours, hf, strict=True)]
    return dict(image_rows_identical=sum(same[:n_img]), image_rows=n_img,
                text_rows_identical=sum(same[n_img:]), text_rows=len(same) - n_img,
                mean_common_prefix=float(np.mean(prefix)))


def measure(eng, hf, b: dict, n: int, args, hf_once: dict, ctx: dict) -> dict:
    """One strategy x batch: HF and edserve alternately, then the edserve step measurements;
    prints the row and returns it. ``hf_once`` caches HF's TTFT / vision time per batch. Each
    system first runs the batch untimed (2 tokens): a shape's first run builds cuDNN attention
    plans and cuBLAS choices (~0.2-2 s here), which the timed run must not count."""
    rows, cuda = len(b["cases"]), args.device == "cuda"
    if n not in hf_once or args.hf_every_strategy:
        fresh_cache(cuda)  # HF gets every cached block our engine is not using
        hf_generate_fitting(hf, b["hf"], 2)  # warm-up at this batch's shapes
        retries = alloc_retries(cuda)
        runs = [hf_generate_fitting(hf, b["hf"], args.new_tokens) for _ in range(args.repeats)]
        hf_tokens, _, chunk = runs[0]
        t_hf = statistics.median(r[1] for r in runs)
        hf_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        hf_once[n] = dict(tokens=hf_tokens, seconds=t_hf, chunk=chunk, peak=hf_peak,
                          ttft=hf_once.get(n, {}).get("ttft"),
                          retries=alloc_retries(cuda) - retries)
        if hf_once[n]["ttft"] is None:
            first = hf_generate_fitting(hf, b["hf"], 1)
            vis_chunk = {k: v[:first[2]] for k, v in b["hf_img"].items()}
            hf_once[n].update(ttft=first[1], vision=hf_vision_seconds(hf, vis_chunk)
                              * n / min(n, first[2]))
    hf_tokens, t_hf, hf_peak = hf_once[n]["tokens"], hf_once[n]["seconds"], hf_once[n]["peak"]
    fresh_cache(cuda)
    run_edserve(eng, b["cases"], 2)  # warm-up at this batch's shapes
    retries = alloc_retries(cuda)
    runs = [run_edserve(eng, b["cases"], args.new_tokens) for _ in range(args.repeats)]
    retries = alloc_retries(cuda) - retries
    tokens, t = runs[0][0], statistics.median(r[1] for r in runs)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    print("#   the timed run's steps: " + ", ".join(
        f"{k} {n} ({1000 * sec:.0f} ms)" for k, (n, sec) in eng.last_steps.items()), flush=True)
    ttft = run_edserve(eng, b["cases"], 1)[1]
    vision = engine_vision_seconds(eng.model, [x for _, x in b["pre"][:n]])
    stats = decode_stats(eng, b["cases"], args.decode_steps)
    floor = floor_ms(ctx["d"], ctx["w_bytes"], b["cases"], b["tiles"], ctx["bw"])
    n_tok, tiles = rows * args.new_tokens, sum(b["tiles"])
    r = dict(size="toy" if args.dry_run else args.size, strategy=ctx["strategy"],
             page_size=ctx["page"], graphs=ctx["graphs"], mixed_steps=ctx["mixed"],
             vision_kernel=ctx["vision_kernel"], image_requests=n,
             text_requests=rows - n, tiles=tiles, new_tokens=args.new_tokens,
             requests_per_s=rows / t, tokens_per_s=n_tok / t, hf_requests_per_s=rows / t_hf,
             hf_tokens_per_s=n_tok / t_hf, ratio_hf=t_hf / t, ttft_s=ttft,
             hf_ttft_s=hf_once[n]["ttft"], vision_ms_per_tile=1000 * vision / tiles,
             hf_vision_ms_per_tile=1000 * hf_once[n]["vision"] / tiles, floor_ms=floor,
             peak_gib=peak, hf_peak_gib=hf_peak, hf_chunk=hf_once[n]["chunk"],
             alloc_retries=retries, hf_alloc_retries=hf_once[n]["retries"], **stats,
             **agreement(tokens, hf_tokens, n))
    busy = "n/a" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%"
    syncs = "n/a" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.2f}"
    mix = ("" if ctx["mixed"] else " nomix") + ("" if ctx["vision_kernel"] == "auto"
                                                   else " " + ctx["vision_kernel"])
    print(f"{ctx['strategy']}/{ctx['page']}{mix} {n:3d} img + {rows - n:2d} txt: "
          f"{r['requests_per_s']:7.2f} req/s {r['tokens_per_s']:8.0f} tok/s "
          f"(HF {r['hf_tokens_per_s']:7.0f}{hf_note(hf_once[n]['chunk'], rows)}, "
          f"x{r['ratio_hf']:.2f}) | TTFT {ttft * 1000:7.1f} ms "
          f"(HF {r['hf_ttft_s'] * 1000:7.1f}) | vision {r['vision_ms_per_tile']:6.2f} ms/tile "
          f"(HF {r['hf_vision_ms_per_tile']:6.2f}) | step {r['step_ms']:6.2f} ms synced, "
          f"{r['overlapped_step_ms']:6.2f} back to back, floor {floor:6.2f} "
          f"(x{r['step_ms'] / floor:.2f}, x{r['overlapped_step_ms'] / floor:.2f}) | busy {busy} "
          f"syncs/step {syncs} | peak "
          f"{peak:5.1f} GiB (HF {hf_peak:5.1f}), alloc retries {retries} (HF "
          f"{r['hf_alloc_retries']}) | same as HF: img "
          f"{r['image_rows_identical']}/{n} txt {r['text_rows_identical']}/{rows - n}",
          flush=True)
    return r


def hf_note(chunk: int, rows: int) -> str:
    """How HF ran a batch it could not hold at once."""
    return "" if chunk >= rows else f" in chunks of {chunk}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="11b", choices=("small", "11b"))
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (fp32, torch ops)")
    ap.add_argument("--batches", default="1,16,64", help="image requests per batch")
    ap.add_argument("--text-ratio", type=float, default=0.125,
                    help="text-only rows per image request (batches of 1 get none)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=8, help="timed decode steps")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed generation runs per system and batch (the median counts; HF's "
                    "figure moved ~10 %% between runs at 64 image requests)")
    ap.add_argument("--strategies", default="flat:1,aligned:128,ragged:1",
                    help="strategy:page_size[:eager][:nomix][:sdpa|:tma|:triton],... (CUDA graphs "
                    "on CUDA unless :eager; ragged always runs eager; :nomix: --no-mixed-steps; "
                    ":sdpa / :tma / :triton / :fa3: the vision tower's attention kernel, default "
                    "auto)")
    ap.add_argument("--dense-tiles", default=None, help="BM,BN,WARPS,STAGES of the Triton "
                    "vision attention (default: the kernel's DEFAULT_TILES)")
    ap.add_argument("--ops", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--hf-every-strategy", action="store_true",
                    help="rerun HF before every strategy (default: once per batch, reused)")
    ap.add_argument("--profile", action="store_true",
                    help="print the top CUDA kernels of a decode step at the largest batch "
                    "(first strategy)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.dry_run else "cuda"
    args.dtype = torch.float32 if args.dry_run else torch.bfloat16
    args.dtype_name = "float32" if args.dry_run else "bfloat16"
    if args.dry_run:
        args.batches, args.new_tokens, args.decode_steps = "2", 4, 2
        args.strategies = "flat:1,aligned:16,ragged:1"
    if args.ops == "auto":
        args.ops = "triton" if args.device == "cuda" else "torch"
    return args


def main(argv=None) -> int:
    from edserve.multimodal.mllama_image import preprocess_images

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run")
        return 2
    set_dense_tiles(args.dense_tiles)
    d = SIZES["toy" if args.dry_run else args.size]
    config = hf_config(d)
    bw, _ = ceilings(args.device)
    t0 = time.perf_counter()
    hf = build_hf(config, args.device, args.dtype)
    w_bytes = text_weight_bytes(hf)
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"# {args.size if not args.dry_run else 'toy'}: {n_params / 1e9:.2f} B params, "
          f"built in {time.perf_counter() - t0:.1f} s on {args.device}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s; ops {args.ops}; {args.new_tokens} new tokens", flush=True)
    from edserve.multimodal.mllama_image import MllamaImageConfig

    icfg = MllamaImageConfig(image_size=d["image"])
    batches = {}
    for n in (int(x) for x in args.batches.split(",")):
        n_text = 0 if n == 1 else max(1, round(n * args.text_ratio))
        cl = cases(d, n, n_text, seed=n)
        pre = [(p, preprocess_images(imgs, icfg) if imgs else None) for p, imgs in cl]
        batches[n] = dict(cases=cl, pre=pre, hf=batch_inputs(hf, pre, args.device),
                          hf_img=batch_inputs(hf, pre[:n], args.device),
                          tiles=[x.num_tiles[0] for _, x in pre[:n]])
    largest = batches[max(batches)]
    hf_generate_fitting(hf, batches[min(batches)]["hf"], 2)  # warm-up (chunked if it must)
    results, hf_once = [], {}
    for spec in args.strategies.split(","):
        strategy, page, *mode = spec.split(":")
        page, want_graph, mixed = int(page), "eager" not in mode, "nomix" not in mode
        opts = dict(vision_kernel=next((k for k in ("sdpa", "tma", "triton", "fa3") if k in mode),
                                       "auto"))
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        eng = make_engine(config, hf, args, strategy, page, largest["pre"], want_graph,
                          mixed, **opts)
        run_edserve(eng, largest["cases"][:2] + largest["cases"][-1:], 2)  # warm-up
        graphs = eng.runner.graph_runner is not None
        print(f"# {spec} ({'graphs' if graphs else 'eager'}): engine built and "
              f"warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        for n, b in batches.items():
            try:
                ctx = dict(strategy=strategy, page=page, mixed=mixed, graphs=graphs, d=d,
                           bw=bw, w_bytes=w_bytes, **opts)
                r = measure(eng, hf, b, n, args, hf_once, ctx)
            except torch.cuda.OutOfMemoryError as e:  # keep the other rows of the run
                r = dict(strategy=strategy, page_size=page, image_requests=n, error=str(e))
                print(f"{strategy}/{page} {n:3d} img: out of GPU memory", flush=True)
            if "error" in r:  # outside the except block, whose frames hold the memory
                del eng  # its state may be mid-step: start a fresh engine
                gc.collect()
                torch.cuda.empty_cache()
                eng = make_engine(config, hf, args, strategy, page, largest["pre"], want_graph,
                                  mixed, **opts)
            results.append(r)
            if args.json:  # after every row: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
        if args.profile and args.device == "cuda" and spec == args.strategies.split(",")[0]:
            profile_step(eng, largest["cases"])
        del eng
    if args.json:
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
