"""Greedy rows beside one beam search (issue 22): does a beam request slow its batch?

Beams chosen on the host make every step of a batch that holds one synchronous, so the greedy
requests beside it lose overlap scheduling; with the beams chosen on the device the batch should
keep it. Random-weight Whisper (bf16 on CUDA), one engine per beam mode, forced length, the
transcription filters on; per batch, the wall time of ``--steps`` consecutive decode steps with
no host sync between them (overlap at work; device time included by a sync at each end),
and the host<->device syncs per step (``torch.cuda.set_sync_debug_mode``):

  greedy G          G greedy requests
  greedy G+B        G + B greedy requests (the rows of the mixed batch, all greedy)
  G + 1 beam B      G greedy requests and one beam-B request (device beams, the default)
  ... host beams    the same with ``beam_on_device=False`` (the old path: synced steps)

Target (issue 22): the mixed batch's step within 5 % of the greedy batch with as many rows.

  python benchmarks/beam_mix_gpu.py --arch large-v3 tiny.en --greedy 64 256
  python benchmarks/beam_mix_gpu.py --dry-run            # toy model on CPU
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import whisper_gpu as wg
from beam_gpu import make_requests

#: decode steps per request: the warm-up, the timed steps and the sync count fit in it
MAX_NEW = 96


def build(hf, arch: str, rows: int, dev: str, beam_on_device: bool,
          run_graphs: bool = True):
    from edserve.models.weights import Checkpoint
    from edserve.runtime import build_engine

    ckpt = Checkpoint(Path(f"<random {arch}>"), "hf", wg.hf_config(arch),
                      dict(hf.state_dict()), wg.tokenizer_path())
    per_row = -(-(1536 + 4 + MAX_NEW + 256) // 128) * 128
    engine = build_engine(checkpoint=ckpt, device=dev,
                          dtype="bfloat16" if dev == "cuda" else "float32",
                          encoder_kv="flat", page_size=128 if dev == "cuda" else 16,
                          max_running_requests=rows, cuda_graph_max_bs=rows,
                          max_total_tokens=rows * per_row + 4096, max_new_tokens=MAX_NEW + 8,
                          debug_checks=False, beam_on_device=beam_on_device)
    if not run_graphs and engine.scheduler.beams is not None:  # A/B: the choice as the graph
        engine.scheduler.beams.graphs = None
    return engine


def steady(engine, feats, greedy: int, beam: int) -> None:
    """``greedy`` greedy requests (+ one beam request when ``beam`` > 1), all decoding."""
    reqs = make_requests(engine, feats[:greedy], MAX_NEW, 1)
    if beam > 1:
        reqs += make_requests(engine, feats[greedy:greedy + 1], MAX_NEW, beam)
    for r in reqs:
        engine.add_request(r)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(4):  # forks done, graphs warm
        engine.step()
    want = greedy + (beam if beam > 1 else 0)
    assert len(engine.scheduler.running) == want, (len(engine.scheduler.running), want)


def step_ms(engine, dev: str, steps: int) -> float:
    """Wall of ``steps`` back-to-back decode steps / steps (no sync between them)."""
    wg.sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wg.sync(dev)
    return 1000 * (time.perf_counter() - t0) / steps


def host_profile(engine, dev: str, steps: int, top: int) -> None:
    """cProfile of ``steps`` back-to-back steps: the ``top`` functions by cumulative and by
    own time (where the host's time per step goes)."""
    def run() -> None:
        for _ in range(steps):
            engine.step()
        wg.sync(dev)

    wg.sync(dev)
    wg.cprofiled(run, top, ("cumulative", "tottime"),
                 order_heading=f"# host profile of {steps} steps by {{order}}")


def device_view(engine, steps: int, rows: int, label: str) -> None:
    """GPU-busy share and the ``rows`` kernels with the most device time per step, then the
    ``rows`` host ops with the most own CPU time per step (torch profiler), over ``steps``
    back-to-back steps: is the step bound by the device or by the host, and where?"""
    busy = wg.step_gpu_busy(engine, steps)
    lines, total = wg.step_kernels(engine, steps, rows, with_total=True)
    print(f"# {label}: GPU busy {100 * busy:.1f} % of the steps' wall; kernels "
          f"{total:.3f} ms/step", flush=True)
    for line in lines:
        print(f"#   {line}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    wg.sync("cuda")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        wg.sync("cuda")
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    print(f"# {label}: host ops by own CPU time per step", flush=True)
    for e in ops:
        print(f"#   {e.self_cpu_time_total / steps / 1000:8.3f} ms/step {e.count / steps:6.1f}x  "
              f"{e.key[:90]}", flush=True)


def measure(engine, feats, dev: str, greedy: int, beam: int, steps: int, repeats: int,
            profile: int = 0, kernels: int = 0) -> tuple[float, float]:
    """(best-of-``repeats`` ms per step, syncs per step); ``profile``: print a host profile
    of the steps after the timed ones (that many functions); ``kernels`` (CUDA): print the
    GPU-busy share and that many kernels per step."""
    best, syncs = float("inf"), float("nan")
    for _ in range(repeats):
        steady(engine, feats, greedy, beam)
        best = min(best, step_ms(engine, dev, steps))
        if profile:
            host_profile(engine, dev, 10, profile)
            profile = 0
        if kernels and dev == "cuda":
            device_view(engine, 10, kernels, f"{greedy} greedy" +
                        (f" + 1 beam {beam}" if beam > 1 else ""))
            kernels = 0
        if dev == "cuda":
            syncs = len(wg.step_syncs(engine, 10)) / 10
        wg.drain(engine)
    engine.check_integrity()
    return best, syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["large-v3", "tiny.en"])
    ap.add_argument("--greedy", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print a host profile (cProfile, N functions) of the mixed batch "
                    "with device beams and of the greedy batch of as many rows")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="CUDA: print the GPU-busy share and the N kernels with the most "
                    "device time per step of the same batches as --profile")
    ap.add_argument("--no-run-graphs", action="store_true",
                    help="device beams without the step's post-sampling work as CUDA graphs "
                    "(only the choice replayed: the path before wave 19), for A/B")
    ap.add_argument("--no-candidate-graphs", action="store_true",
                    help="sample batches holding beam rows eagerly (no sampling graph for "
                    "top-k candidates: the path before wave 19), for A/B")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    if args.no_candidate_graphs:
        import edserve.engine.sample_graphs as sample_graphs

        sample_graphs.candidate_key = lambda plan: () if plan.candidates is None else None
    dev = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.arch, args.greedy, args.steps, args.repeats = ["toy"], [4], 5, 1
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    b = args.beam
    print(f"# {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; flat page 128 "
          f"(CPU 16), forced {MAX_NEW} tokens, filters on; ms per step over {args.steps} "
          f"back-to-back steps, best of {args.repeats}", flush=True)
    print("arch      G    greedy G ms  greedy G+B ms  G+beam (device) ms  x G+B  syncs  "
          "G+beam (host) ms  x G+B  syncs")
    for arch in args.arch:
        hf = wg.build_hf(arch, dev, dtype)
        for g in args.greedy:
            gen = torch.Generator().manual_seed(g)
            feats = (torch.randn(g + b, wg.ARCHS[arch]["n_mels"], 3000, generator=gen)
                     * 0.5).to(device=dev, dtype=dtype)
            res = {}
            for on_device in (True, False):
                engine = build(hf, arch, g + b, dev, on_device, not args.no_run_graphs)
                prof = args.profile if on_device else 0
                kern = args.kernels if on_device else 0
                if on_device:
                    res["g"] = measure(engine, feats, dev, g, 1, args.steps, args.repeats)
                    res["gb"] = measure(engine, feats, dev, g + b, 1, args.steps,
                                        args.repeats, prof, kern)
                res[on_device] = measure(engine, feats, dev, g, b, args.steps, args.repeats,
                                         prof, kern)
                del engine
                gc.collect()
                if dev == "cuda":
                    torch.cuda.empty_cache()
            ref = res["gb"][0]
            print(f"{arch:8s} {g:4d}  {res['g'][0]:11.2f}  {ref:13.2f}  {res[True][0]:18.2f}  "
                  f"{res[True][0] / ref:5.2f}  {res[True][1]:5.2f}  {res[False][0]:16.2f}  "
                  f"{res[False][0] / ref:5.2f}  {res[False][1]:5.2f}", flush=True)
        del hf


if __name__ == "__main__":
    main()
