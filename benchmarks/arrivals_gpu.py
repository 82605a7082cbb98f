"""Requests arriving while others decode: throughput and the longest decode gap, mixed steps on
and off, per prefill budget (random weights, forced length, transcription filters on).

Two drivers over the same ``--requests`` log-mels (host tensors, ready before timing):
  all at once  every request submitted before the first step (``Engine.generate``)
  callers      ``--concurrency`` closed-loop callers: a request is submitted the moment one
               finishes (from its finish callback), so arrivals prefill while others decode
Reported: requests/s of each, the callers' share of the all-at-once figure and of the floor
(``whisper_gpu.floor_seconds`` at ``--concurrency``, printed with and without the cross-K/V
projection), and for the callers the gaps between two consecutive steps of a running row (the
wall time between the ``schedule()`` calls that carry it; ``max`` is the issue's "longest
gap", also in steps).

  python benchmarks/arrivals_gpu.py --arch large-v3 --budgets 24576 49152 262144
  python benchmarks/arrivals_gpu.py --dry-run      # toy model on CPU: the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import whisper_gpu as wg
from whisper_realpath import filters

from edserve.engine.request import GenerateRequest, SamplingParams


def requests(engine, mels: list[torch.Tensor], new_tokens: int) -> list[GenerateRequest]:
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [GenerateRequest([tok.sot], m, sp, logits_processors=filters(tok)) for m in mels]


class GapWatch:
    """Wraps ``engine.scheduler.schedule``: per running row, the wall time and the number of
    steps between two steps that carry it."""

    def __init__(self, engine) -> None:
        self.engine, self.last, self.gaps_ms, self.gap_steps = engine, {}, [], []
        self.step = 0
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._watched

    def _watched(self):
        sched = self._schedule()
        now = time.perf_counter()
        self.step += 1
        if sched is not None:
            for r in sched.reqs:
                if r.serial in self.last:
                    t, s = self.last[r.serial]
                    self.gaps_ms.append(1000 * (now - t))
                    self.gap_steps.append(self.step - s)
                self.last[r.serial] = (now, self.step)
        return sched

    def close(self) -> None:
        self.engine.scheduler.schedule = self._schedule


def all_at_once(engine, reqs) -> float:
    dev = str(engine.device)
    wg.sync(dev)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wg.sync(dev)
    assert all(o.error is None for o in outs)
    return len(reqs) / (time.perf_counter() - t0)


def callers(engine, reqs, concurrency: int) -> tuple[float, GapWatch]:
    pending = list(reversed(reqs))
    done = []

    def submit() -> None:
        if pending:
            engine.add_request(pending.pop(), on_finish, stream=False)

    def on_finish(delta) -> None:
        if delta.finished:
            done.append(delta.output)
            submit()  # the caller's next request arrives at once

    for _ in range(concurrency):
        submit()
    watch = GapWatch(engine)
    dev = str(engine.device)
    wg.sync(dev)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    wg.sync(dev)
    rate = len(reqs) / (time.perf_counter() - t0)
    watch.close()
    assert len(done) == len(reqs) and all(o.error is None for o in done)
    return rate, watch


def device_and_dtype(args) -> tuple[str, torch.dtype]:
    """CUDA in bf16, or with ``--dry-run`` the toy model on CPU in fp32 with a few requests
    (shared with ``gpu_idle.py``)."""
    if args.dry_run:
        args.arch, args.requests, args.concurrency, args.new_tokens = "toy", 6, 3, 3
        return "cpu", torch.float32
    return "cuda", torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--budgets", nargs="+", type=int, default=[24576, 262144],
                    help="--max-prefill-tokens values (Whisper: 1501 per request)")
    ap.add_argument("--config", default="flat:128", help="strategy:page_size")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    dev, dtype = device_and_dtype(args)
    if args.dry_run:
        args.budgets = [1501 * 2]
    hf = wg.build_hf(args.arch, dev, dtype)
    strategy, ps = args.config.split(":")
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(wg.ARCHS[args.arch]["n_mels"], 3000, generator=gen) * 0.5
            for _ in range(args.requests)]
    print(f"# {args.arch} {strategy}/{ps}, {args.requests} requests x {args.new_tokens} tokens, "
          f"{args.concurrency} callers, filters on")
    bw, flops = wg.ceilings(dev)
    floor = args.concurrency / wg.floor_seconds(args.arch, args.concurrency, args.new_tokens,
                                                bw, flops)
    print(f"# {wg.short_floor(args.arch, args.concurrency, args.new_tokens, bw, flops)}")
    print("mixed  budget   all-at-once req/s  callers req/s  share  %floor  gap ms p50 / max  "
          "max gap steps")
    for budget in args.budgets:
        for mixed in (True, False):
            engine = wg.make_engine(hf, args.arch, args.requests, args.new_tokens, device=dev,
                                    dtype=str(dtype)[6:], encoder_kv=strategy, page_size=ps,
                                    max_prefill_tokens=budget, mixed_steps=mixed,
                                    debug_checks=False)
            engine.generate(requests(engine, mels[:4], 2))  # warm-up
            burst = all_at_once(engine, requests(engine, mels, args.new_tokens))
            rate, watch = callers(engine, requests(engine, mels, args.new_tokens),
                                  args.concurrency)
            engine.check_integrity()
            print(f"{'on' if mixed else 'off':5s} {budget:7d}  {burst:17.1f}  {rate:13.1f}  "
                  f"{100 * rate / burst:4.0f}%  {100 * rate / floor:5.1f}  "
                  f"{statistics.median(watch.gaps_ms):6.1f} / "
                  f"{max(watch.gaps_ms):7.1f}  {max(watch.gap_steps):13d}", flush=True)
            del engine, watch
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
