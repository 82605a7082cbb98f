"""Tensor parallelism on the 11B-size Mllama (random weights): TP 1 vs TP 2, tokens and the
decode step at 64 concurrent requests.

Model: Llama-3.2-11B-Vision's shapes (text 40 layers of which 8 cross-attention, 4096 hidden,
32 q / 8 kv heads, SwiGLU 14336, vocab 128256; vision 32 + 8 layers of 1280, 560 px tiles),
seeded random weights built on every rank's GPU (``RandomMllama``: the same weights everywhere).

1. Tokens (``--check-dtype``, default float32; torch's default TF32 settings on every rank):
   a few mixed requests (image of 1-4 tiles, text before the image, text-only), greedy, TP 1
   vs TP 2 (target: identical).
2. Decode step (bf16): ``--concurrent`` requests (default 64; one ``--tiles``-tile image each
   + a short prompt) admitted together, then the median wall time of ``--steps`` decode steps,
   TP 1 (eager and, when supported, CUDA graphs) vs TP 2 (eager: the followers mirror eager
   calls). Target: TP 2 <= 0.6 x TP 1.

  python benchmarks/tp_gpu.py                  # a host with >= 2 GPUs (nvidia-h200-x2)
  python benchmarks/tp_gpu.py --dry-run        # toy shapes on CPU, 2 gloo ranks
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))
# The follower ranks unpickle ``tp_gpu.RandomMllama``: they need this folder on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_HERE), str(_HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

from mllama_gpu import cases  # noqa: E402
from mllama_hf import SIZES, hf_config  # noqa: E402
from mllama_random import choose_ops, random_state_dict, run  # noqa: E402
from whisper_gpu import median_step_ms, sync  # noqa: E402

DIMS_11B = SIZES["11b"]


class RandomMllama:
    """Picklable checkpoint factory: every rank calls it and gets the same seeded weights, on
    its current device (each rank's own GPU, or the CPU)."""

    def __init__(self, dims: dict, dtype: str) -> None:
        self.dims, self.dtype = dims, dtype

    def __call__(self):
        from edserve.models.weights import Checkpoint

        config = hf_config(self.dims)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        sd = random_state_dict(config, device, getattr(torch, self.dtype))
        return Checkpoint(Path("<random mllama>"), "hf", config, sd, Path("/nonexistent"))


def make_engine(factory: RandomMllama, tp: int, device: str, ops: str, rows: int, tiles: int,
                new_tokens: int, graphs: bool):
    """TP > 1: every rank calls ``factory``; TP 1: this process alone."""
    from tp_gpu import RandomMllama as Importable  # pickled by module name, not __main__

    from edserve.runtime import build_engine

    dims, dtype = factory.dims, factory.dtype
    factory = Importable(dims, dtype) if tp > 1 else factory()

    img = dims["image"]
    enc = tiles * ((img // 14) ** 2 + 1)
    per_req = enc + 128 + 64 + new_tokens  # + page rounding slack
    return build_engine(checkpoint=factory, device=device, dtype=dtype, encoder_kv="flat",
                  page_size="128" if device == "cuda" else "16", attention_backend=ops,
                  max_running_requests=rows, max_total_tokens=rows * per_req + 8192,
                  context_length=256, max_new_tokens=new_tokens, cuda_graph=graphs,
                  tensor_parallel_size=tp)


def decode_requests(dims: dict, n: int, tiles: int):
    """``n`` prompts with one ``tiles``-tile image each (tile shapes of mllama_gpu)."""
    return cases(dims, 4 * n, 0)[tiles % 4::4][:n]  # request i has (i + 3) % 4 + 1 tiles


def decode_step_ms(engine, reqs: list, new_tokens: int, steps: int, dev: str) -> float:
    from edserve.chat.mllama_request import make_mllama_request
    from edserve.engine.request import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for prompt, images in reqs:
        engine.add_request(make_mllama_request(engine.model, prompt, images, sp))
    engine.step()  # prefill: every request admitted at once
    if len(engine.scheduler.running) != len(reqs):
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {len(reqs)} requests were "
                           "admitted together; raise --max-total-tokens")
    for _ in range(3):  # warm-up decode steps
        engine.step()
    ms = median_step_ms(engine, dev, steps)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return ms


def free_memory() -> None:
    """After the caller dropped its engine: collect it and hand its GPU memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="toy shapes on CPU, 2 gloo ranks")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1")
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--tiles", type=int, default=1, choices=(1, 2, 3, 4))
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed")
    ap.add_argument("--check-steps", type=int, default=16)
    ap.add_argument("--check-dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}; use --dry-run")
        return 2
    if args.dry_run:
        args.concurrent, args.steps, args.check_steps = min(args.concurrent, 8), 4, 6
    dims = SIZES["toy"] if args.dry_run else DIMS_11B
    ops = choose_ops(dev)
    from edserve.parallel import shutdown

    # --- 1. tokens -------------------------------------------------------------------------
    check = [cases(dims, 4, 2)[i] for i in (1, 2, 3, 4, 5)]
    tokens = {}
    for tp in (1, args.tp):
        t = time.perf_counter()
        eng = make_engine(RandomMllama(dims, args.check_dtype), tp, dev, ops, len(check), 4,
                          args.check_steps, graphs=False)
        tokens[tp], _ = run(eng, check, args.check_steps)
        eng.check_integrity()
        print(f"TP {tp} ({args.check_dtype}): {len(check)} requests x {args.check_steps} "
              f"tokens ({time.perf_counter() - t:.1f} s with start-up)", flush=True)
        del eng
        free_memory()
    same = sum(a == b for a, b in zip(tokens[1], tokens[args.tp], strict=True))
    print(f"TP {args.tp} tokens identical to TP 1: {same} / {len(check)} requests")

    # --- 2. decode step --------------------------------------------------------------------
    reqs = decode_requests(dims, args.concurrent, args.tiles)
    n_new = args.steps + 8
    results = {}
    runs = [(1, False), (args.tp, False)] + ([(1, True)] if dev == "cuda" else [])
    for tp, graphs in runs:
        eng = make_engine(RandomMllama(dims, "bfloat16" if dev == "cuda" else "float32"), tp,
                          dev, ops, args.concurrent, args.tiles, n_new, graphs)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = decode_step_ms(eng, reqs, n_new, args.steps, dev)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
        results[(tp, graphs)] = ms
        print(f"TP {tp}{' + CUDA graphs' if graphs else ''}: decode step {ms:.2f} ms at "
              f"{args.concurrent} concurrent ({args.tiles}-tile images), rank-0 peak memory "
              f"{peak:.1f} GiB (during the run)", flush=True)
        del eng
        free_memory()
        sync(dev)
    ratio = results[(args.tp, False)] / results[(1, False)]
    print(f"TP {args.tp} / TP 1 decode step (eager both): {ratio:.2f}x (target <= 0.6)"
          + (" [dry run: toy shapes on a shared CPU, the times mean nothing]"
             if args.dry_run else ""))
    shutdown()
    ok = same == len(check)
    print("PASS" if ok else "FAIL (tokens differ)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
