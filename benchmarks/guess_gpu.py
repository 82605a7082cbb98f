"""Engine-level A/B of language guessing: windows that detect the language in the row vs
windows that guess it (the prompt check), and windows given the language, alternated in one
process on one engine.

``Engine.generate`` on ``--requests`` first windows of ``tests/data/jfk.wav`` (random-weight
HF folder, ``--arch`` shapes, the tiny.en tokenizer; 17 new text tokens per window, fallback
off: serve_gpu.py's engine figure), and one window alone (``--single`` times: the latency of
one request). Prints requests/s, ms per single request and the decode steps per request.

  python benchmarks/guess_gpu.py                    # H200: large-v3
  python benchmarks/guess_gpu.py --arch toy --device cpu --requests 8 --rows 4 --single 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import serve_gpu as sg
import torch
import whisper_gpu as wg

from edserve.audio.decode import load_audio
from edserve.runtime import build_engine
from edserve.whisper.language import LanguageGuess
from edserve.whisper.transcribe import make_task

MODES = ("in-row", "guess", "given")


def run(engine, clip, mode: str, n: int, guess: LanguageGuess) -> tuple[float, float]:
    """(seconds, decoding rows per request: its decode steps) of ``n`` windows in ``mode``."""
    opts = sg.options()
    if mode == "given":
        opts = dataclasses.replace(opts, language=guess.code)
    tasks = [make_task(engine, clip, opts, "clip", guess) for _ in range(n)]
    if mode == "in-row":
        for t in tasks:
            t.guess = None
    reqs = [t.next_request() for t in tasks]
    before = engine.step_counters.snapshot()
    wg.sync(str(engine.device))
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wg.sync(str(engine.device))
    took = time.perf_counter() - t0
    after = engine.step_counters.snapshot()
    assert all(o.error is None for o in outs), outs[0].error
    for t, o in zip(tasks, outs, strict=True):
        t.feed(o)
        for h in t.abandon():
            engine.release_encoder(h)
    wrong = sum(not o.token_ids for o in outs)
    if wrong:
        print(f"# {mode}: {wrong} of {n} guesses wrong", flush=True)
    # decoding rows carried by every step (a mixed step's admitted rows are not decoding)
    rows = sum(after[k].rows - before[k].rows - (after[k].new_rows - before[k].new_rows)
               for k in ("decode", "mixed"))
    return took, rows / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--single", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    folder = sg.save_folder(args.arch, Path(tempfile.mkdtemp()), args.device)
    engine = build_engine(model=str(folder), device=args.device, max_running_requests=args.rows,
                          context_length=sg.CONTEXT)
    clip = load_audio(sg.DATA / "jfk.wav")
    guess = LanguageGuess()
    for mode in MODES:  # warm-up (the guess learns the model's language here)
        run(engine, clip, mode, args.rows, guess)
    print(f"# {args.arch}, {args.requests} windows at {args.rows} rows; guessed language "
          f"{guess.code}", flush=True)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    single: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, float] = {}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            took, steps[mode] = run(engine, clip, mode, args.requests, guess)
            rates[mode].append(args.requests / took)
            for _ in range(args.single):
                single[mode].append(1000 * run(engine, clip, mode, 1, guess)[0])
    print("mode     req/s (each repeat)        median   one request ms (p50)  decode steps/req")
    for m in MODES:
        print(f"{m:7s}  {' '.join(f'{x:6.1f}' for x in rates[m]):24s}  "
              f"{statistics.median(rates[m]):6.1f}   {statistics.median(single[m]):8.1f}"
              f"              {steps[m]:.1f}", flush=True)
    engine.check_integrity()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
