"""The host work at the two ends of a beam run, on CPU: torch ops and wall time of every
``engine.step()`` of ``--requests`` requests x beam ``--beam`` (device beams, overlap on) on a
tiny random Whisper, forced ``--new-tokens`` tokens. On a GPU each torch op is at least one
launch, so the admission step's and the last step's op counts are what they cost the host
there (``benchmarks/beam_timeline.py`` times the same ends on the H200).

  python benchmarks/beam_ends_cpu.py [--requests 64] [--beam 5] [--new-tokens 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from whisper_fixtures import make_random_whisper  # noqa: E402

from edserve.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from edserve.runtime import build_engine  # noqa: E402


class OpCount(TorchDispatchMode):
    """Counts the torch ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def run(engine, mels, beam: int, new: int, count: bool) -> list[tuple[int, float]]:
    """(torch ops or 0, wall ms) of every step of one run."""
    for m in mels:
        engine.add_request(GenerateRequest([50257, 50362], m, SamplingParams(
            beam_size=beam, max_new_tokens=new, ignore_eos=True)), lambda d: None, stream=False)
    steps = []
    while engine.has_work():
        c = OpCount() if count else None
        t = time.perf_counter()
        if c is None:
            engine.step()
        else:
            with c:
                engine.step()
        steps.append((c.n if c else 0, 1e3 * (time.perf_counter() - t)))
    return steps


def measure(requests: int, beam: int, new: int) -> list[tuple[int, float]]:
    """(torch ops, wall ms) of every step of a run (ops and times from two runs after a
    warm-up)."""
    folder = make_random_whisper(Path(tempfile.mkdtemp()), d_model=32, layers=1, heads=2,
                                 source_positions=56)
    engine = build_engine(model=str(folder), device="cpu", dtype="float32",
                          max_running_requests=requests * beam, beam_on_device=beam > 1,
                          overlap_schedule="on", max_new_tokens=64)
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(80, 112, generator=gen) * 0.5 for _ in range(requests)]
    run(engine, mels, beam, new, False)  # warm-up
    ops = run(engine, mels, beam, new, True)
    wall = run(engine, mels, beam, new, False)
    engine.check_integrity()
    return [(n, ms) for (n, _), (_, ms) in zip(ops, wall, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=6)
    args = ap.parse_args(argv)
    steps = measure(args.requests, args.beam, args.new_tokens)
    print(f"# {args.requests} requests x beam {args.beam}, {args.new_tokens} tokens, tiny "
          "random Whisper, CPU")
    print("| step | torch ops | wall ms |\n|---:|---:|---:|")
    for i, (n, ms) in enumerate(steps):
        print(f"| {i} | {n} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
