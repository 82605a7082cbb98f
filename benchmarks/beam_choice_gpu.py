"""The device beam choice alone: one step of ``BeamBatch`` as the tensor ops vs the one-launch
Triton kernel (``--beam-choice ops|triton``), each replayed as a CUDA graph (as the engine runs
it), at the engine's layout (16 slots a group, 448 history columns) and beam 5.

Prints per configuration the device time of one step (CUDA events over ``--steps`` replays,
median of ``--repeats``), the kernels a step launches (torch profiler), and whether the two
versions' results after the timed steps are equal (they must be, bit for bit).

  python benchmarks/beam_choice_gpu.py --groups 16 64
  python benchmarks/beam_choice_gpu.py --dry-run     # CPU, Triton interpreter: the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from edserve.engine.beam_device import BeamBatch  # noqa: E402
from edserve.engine.beam_graph import make_beam_stepper  # noqa: E402


def make(choice: str, groups: int, beam: int, width: int, cols: int, dev: str, stepper: str):
    """A batch of ``groups`` live beam groups and its stepper, candidates filled (seeded)."""
    st = BeamBatch(groups, width, cols, dev, choice)
    for g in range(groups):
        st.admit(g, beam, None, frozenset({50257}))
    run = make_beam_stepper(st, width + 1, stepper)
    toks, lps, _ = run.inputs()
    gen = torch.Generator().manual_seed(0)
    toks.copy_(torch.randint(0, 50000, toks.shape, generator=gen))
    lps.copy_((-3 * torch.rand(lps.shape, generator=gen)).sort(dim=2, descending=True).values)
    return st, run


def step_us(run, steps: int, dev: str) -> float:
    if dev != "cuda":
        run.step()
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run.step()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / steps


def kernels_per_step(run, dev: str) -> int:
    if dev != "cuda":
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run.step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--width", type=int, default=16, help="slots a group (the engine's: 16)")
    ap.add_argument("--cols", type=int, default=448, help="history columns (max decoder len)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    stepper = "eager" if args.dry_run else "graph"
    if args.dry_run:
        args.groups, args.width, args.cols, args.steps, args.repeats = [2], 6, 16, 1, 1
    print(f"# beam choice on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: beam "
          f"{args.beam}, {args.width} slots a group, {args.cols} columns, {stepper} steps, "
          f"{args.steps} steps a timing, median of {args.repeats}")
    print("| groups | ops us/step | ops kernels | triton us/step | triton kernels | equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for groups in args.groups:
        pairs = {c: make(c, groups, args.beam, args.width, args.cols, dev, stepper)
                 for c in ("ops", "triton")}
        us = {c: [] for c in pairs}
        for _ in range(args.repeats):  # alternate
            for c, (_, run) in pairs.items():
                us[c].append(step_us(run, args.steps, dev))
        counts = {c: kernels_per_step(run, dev) for c, (_, run) in pairs.items()}
        # both ran the same steps on the same inputs: their states must be equal
        a, b = (st.tensors() for st, _ in pairs.values())
        equal = all(torch.equal(x.nan_to_num(7.0) if x.is_floating_point() else x,
                                b[k].nan_to_num(7.0) if x.is_floating_point() else b[k])
                    for k, x in a.items())
        print(f"| {groups} | {statistics.median(us['ops']):.1f} | {counts['ops']} | "
              f"{statistics.median(us['triton']):.1f} | {counts['triton']} | {equal} |",
              flush=True)
        assert equal, "the Triton choice differs from the tensor ops"
    return 0


if __name__ == "__main__":
    sys.exit(main())
