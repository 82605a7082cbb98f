"""CPU micro-benchmark: Whisper ``encode`` and encode + prefill for a batch of clips.

Random weights of tiny.en size (d 384, 4 + 4 layers, 6 heads), float32 on the CPU; run it from
the repository root::

    python benchmarks/cpu_prefill.py [--clips 8] [--repeats 5] [--threads 1]

It prints the best-of-``repeats`` wall and CPU time of ``model.encode(mels)`` and of one engine
step that admits every clip (encoder + decoder prefill with the cross K/V write + sampling one
token).
To compare with another checkout, put that checkout's package first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # whisper_fixtures

from whisper_fixtures import make_random_whisper  # noqa: E402

import edserve  # noqa: E402
from edserve.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from edserve.runtime import build_engine  # noqa: E402

PROMPT = [50257, 50362]


def _best(fn, repeats: int) -> tuple[float, float]:
    """Best wall time and best process CPU time (all threads) of ``repeats`` calls, in ms.
    On a shared machine the CPU time with ``--threads 1`` is the steadier number."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall * 1e3, cpu * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(80, 3000, generator=gen) * 0.5 for _ in range(args.clips)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_random_whisper(Path(tmp), d_model=384, layers=4, heads=6)
        engine = build_engine(model=str(folder), device="cpu", dtype="float32",
                        max_running_requests=args.clips, max_prefill_tokens=1 << 20)
    model = engine.model
    encodes = []
    encode = model.encode
    model.encode = lambda xs: encodes.append(len(xs)) or encode(xs)  # count encoder batches

    def run_encode() -> None:
        with torch.inference_mode():
            encode(mels)

    def run_prefill() -> None:
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        outs = engine.generate([GenerateRequest(PROMPT, m, params) for m in mels])
        assert all(o.error is None for o in outs)

    run_encode()
    run_prefill()  # warm-up
    encodes.clear()
    t_enc = _best(run_encode, args.repeats)
    t_pre = _best(run_prefill, args.repeats)
    assert encodes == [args.clips] * args.repeats, encodes  # one encoder batch per step
    print(f"edserve from {Path(edserve.__file__).parent}")
    print(f"{args.clips} clips, {torch.get_num_threads()} threads, best of {args.repeats} "
          f"(wall / CPU ms): encode {t_enc[0]:.0f} / {t_enc[1]:.0f}, "
          f"encode + prefill step {t_pre[0]:.0f} / {t_pre[1]:.0f}")


if __name__ == "__main__":
    main()
