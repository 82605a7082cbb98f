"""CPU Whisper step timings in one process: encoder ms, decode ms per step and the host share of a
decode step, eager vs compiled (``--cpu-compile``), for each mode and beam width.

Each configuration (``fp32``/``int8`` x beam sizes x ``eager``/``compiled``) gets its own engine
on the embedded tiny.en; compiled engines compile their shapes before timing (``compile s``:
this process's compile time, on whatever inductor cache ``$EDSERVE_CACHE/inductor`` holds).
Rounds interleave the configurations (a shared machine's load hits all alike); medians over
rounds. The host share of a decode step is ``1 - compute / wall`` over the decode steps of one
clip, where compute is the self CPU time of the compute kernels under the torch profiler
(GEMMs, int8 linears, attention, convolutions and inductor's generated kernels:
:data:`COMPUTE`) and wall either the profiled steps' wall time (the profiler's per-op cost
counted as host work) or the same steps' wall time run again without the profiler.

  python benchmarks/cpu_step.py [--rounds 3] [--threads 2] [--clips 10] [--beam-sizes 1 5]
  python benchmarks/cpu_step.py --encoder-attention      # SDPA flash vs math, 1500 x 1500
  python benchmarks/cpu_step.py --beam-vs-rows --modes auto int8  # beam 5 vs 5 greedy rows
  python benchmarks/cpu_step.py --host-split --modes auto int8    # compute / other ops / Python
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch

# Profiler events whose self time is compute (everything else in a step is host work).
COMPUTE = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv_",
           "quantized::linear_dynamic", "edserve_int8::linear",
           "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mkldnn_convolution",
           "aten::index_select", "## Call CompiledFxGraph", "mkldnn::_linear_pointwise")


def cpu_description() -> str:
    """``model name`` of /proc/cpuinfo, the SIMD flags that matter, torch's capability."""
    from edserve.engine.cpu_modes import cpu_features

    name = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}; features {sorted(cpu_features())}"


class StepClock:
    """Wraps an engine's runner: wall time of encoder runs and of decode steps."""

    def __init__(self, engine) -> None:
        self.encode_s: list[float] = []
        self.decode_s: list[float] = []
        runner = engine.runner
        run, encode = runner.run, runner._encode

        def timed_encode(reqs):
            t0 = time.perf_counter()
            out = encode(reqs)
            if out is not None:
                self.encode_s.append(time.perf_counter() - t0)
            return out

        def timed_run(sched):
            # the profiler's marker only under the profiler (~5 us a step otherwise)
            mark = torch.profiler.record_function(f"ModelRunner.{sched.mode.name.lower()}") \
                if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()
            t0 = time.perf_counter()
            with mark:
                out = run(sched)
            if sched.mode.name == "DECODE":
                self.decode_s.append(time.perf_counter() - t0)
            return out

        runner._encode, runner.run = timed_encode, timed_run

    def reset(self) -> None:
        self.encode_s.clear()
        self.decode_s.clear()

    def mean_decode_s(self) -> float:
        """Mean wall seconds of the decode steps timed since :meth:`reset` (nan: none)."""
        return sum(self.decode_s) / len(self.decode_s) if self.decode_s else float("nan")


def step_split(fn, clock: StepClock) -> tuple[dict[str, float], Counter]:
    """Seconds of the profiled decode steps of one call of ``fn`` by kind: ``wall``,
    ``compute`` (self time of :data:`COMPUTE` ops), ``other ops`` (every other op's self time:
    small kernels and views) and ``python`` (the steps' own self time: Python between ops);
    and the other ops by name."""
    from torch.profiler import ProfilerActivity, profile

    clock.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    split = {"wall": sum(clock.decode_s), "compute": 0.0, "other ops": 0.0, "python": 0.0}
    others: Counter = Counter()
    for ev in (e for e in prof.events() if e.name == "ModelRunner.decode"):
        split["python"] += ev.self_cpu_time_total / 1e6
        stack = list(ev.cpu_children)
        while stack:
            e = stack.pop()
            if any(e.name.startswith(c) for c in COMPUTE):
                split["compute"] += e.self_cpu_time_total / 1e6
            else:
                split["other ops"] += e.self_cpu_time_total / 1e6
                others[e.name] += e.self_cpu_time_total / 1e6
            stack.extend(e.cpu_children)
    return split, others


def host_shares(fn, clock: StepClock) -> tuple[float, float]:
    """The host share of the decode steps of one call of ``fn``, two ways: ``1 - compute /
    wall`` with the profiled steps' wall (the torch profiler's own per-op cost then counts as
    host work: the more small ops a step has, the more it inflates), and with the wall of the
    same steps run again without the profiler (``compute`` stays the profiled kernels' self
    time, per step)."""
    split, _ = step_split(fn, clock)
    n = len(clock.decode_s)
    if not n or not split["wall"]:
        return float("nan"), float("nan")
    clock.reset()
    fn()
    plain = clock.mean_decode_s()
    return 1 - split["compute"] / split["wall"], 1 - split["compute"] / n / plain


def _jfk():
    """tests/data/jfk.wav as 16 kHz float32 samples."""
    import numpy as np
    from cpu_whisper import DATA

    from edserve.audio.decode import load_audio

    return load_audio(str(DATA / "jfk.wav")).astype(np.float32)


def print_host_split(modes: list[str], beams: list[int], threads: int) -> None:
    """``--host-split``: where an eager decode step's host share goes (jfk)."""
    clip = _jfk()
    print(f"# {cpu_description()}; threads {threads}; jfk; eager decode steps, ms per step")
    print("| mode | beam | wall unprofiled | wall | compute | other ops | Python | "
          "largest other ops |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for mode in modes:
        for beam in beams:
            fn, clock = build(mode, beam, False, threads)
            fn(clip)
            clock.reset()
            fn(clip)
            plain = 1e3 * clock.mean_decode_s()
            split, others = step_split(lambda fn=fn: fn(clip), clock)
            n = max(1, len(clock.decode_s))
            ms = {k: 1e3 * v / n for k, v in split.items()}
            top = ", ".join(f"{k} {1e3 * v / n:.2f}" for k, v in others.most_common(5))
            print(f"| {mode} | {beam} | {plain:.2f} | {ms['wall']:.2f} | {ms['compute']:.2f} | "
                  f"{ms['other ops']:.2f} | {ms['python']:.2f} | {top} |")


def encoder_attention(threads: int, rounds: int = 20) -> None:
    """Whisper encoder self-attention (1500 x 1500, tiny.en's 6 heads of 64) in float32:
    SDPA's CPU flash kernel (what the encoder calls) vs SDPA's math path vs an explicit
    softmax(q k^T) v; medians of interleaved rounds."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(threads)
    q, k, v = (torch.randn(1, 6, 1500, 64) for _ in range(3))

    def explicit():
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    def kernel(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        return run
    fns = {"SDPA flash (CPU)": kernel(SDPBackend.FLASH_ATTENTION),
           "SDPA math": kernel(SDPBackend.MATH), "explicit softmax(qk^T)v": explicit}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print("| encoder attention, 1 x 6 heads x 1500 x 1500 | ms (one layer) |\n|---|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} |")


# mode -> (--dtype, --quantization); ``auto`` is what the CLI runs (bfloat16 on AMX CPUs)
MODES = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "auto": ("auto", "none"),
         "int8": ("auto", "int8")}


def build(mode: str, beam: int, compiled: bool, threads: int):
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    dtype, quantization = MODES[mode]
    engine = build_engine(device="cpu", threads=threads, max_running_requests=beam,
                          dtype=dtype, quantization=quantization,
                          cpu_compile="on" if compiled else "off")
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=beam)
    clock = StepClock(engine)
    return (lambda audio: transcribe(engine, [audio], options=opts)[0].text), clock


def beam_vs_rows(modes: list[str], threads: int, rounds: int, width: int = 5) -> None:
    """Issue 23's "a beam step costs little more than a greedy step of as many rows": median
    decode step of one clip at beam ``width``, of ``width`` copies of it greedy (as many rows,
    ``width`` encoder regions), and of the clip alone greedy; eager, rounds interleaved."""
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    clip = _jfk()
    cases = ((f"beam {width}, 1 clip", [clip], width),
             (f"greedy, {width} clips", [clip] * width, 1), ("greedy, 1 clip", [clip], 1))
    print(f"# {cpu_description()}; threads {threads}; jfk; eager steps; medians per round")
    for mode in modes:
        dtype, quantization = MODES[mode]
        engine = build_engine(device="cpu", threads=threads, dtype=dtype,
                              quantization=quantization, max_running_requests=2 * width,
                              cpu_compile="off")
        clock, ms = StepClock(engine), {name: [] for name, _, _ in cases}
        for _ in range(rounds):
            for name, inputs, beam in cases:
                opts = TranscribeOptions(language="en", beam_size=beam, timestamps=False,
                                         temperatures=(0.0,))
                clock.reset()
                transcribe(engine, inputs, options=opts)
                ms[name].append(statistics.median(clock.decode_s) * 1e3)
        for name, v in ms.items():
            print(f"| {mode} | {name} | {' / '.join(f'{x:.2f}' for x in v)} ms |")


def main() -> None:
    import numpy as np
    from cpu_whisper import clips

    from edserve.audio.decode import load_audio

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clips", type=int, default=None)
    ap.add_argument("--modes", nargs="+", default=["fp32", "int8"], choices=sorted(MODES),
                    help="fp32 / bf16: that dtype; auto: the CLI's --dtype auto (bf16 on AMX); "
                         "int8: --quantization int8 (float32 activations)")
    ap.add_argument("--beam-sizes", nargs="+", type=int, default=[1, 5])
    ap.add_argument("--encoder-attention", action="store_true",
                    help="only time the encoder's attention kernels")
    ap.add_argument("--host-split", action="store_true",
                    help="only split eager decode steps into compute, other ops and Python")
    ap.add_argument("--beam-vs-rows", action="store_true",
                    help="only compare a beam-5 step with a greedy step of 5 clips' rows")
    args = ap.parse_args()
    if args.encoder_attention:
        return encoder_attention(args.threads)
    torch.set_num_threads(args.threads)
    if args.host_split:
        return print_host_split(args.modes, args.beam_sizes, args.threads)
    if args.beam_vs_rows:
        return beam_vs_rows(args.modes, args.threads, args.rounds)
    paths = clips()[:args.clips]
    audios = [load_audio(p).astype(np.float32) for p in paths]
    print(f"# {cpu_description()}; threads {args.threads}; {len(paths)} clips; medians of "
          f"{args.rounds} interleaved rounds")
    configs, compile_s, texts = {}, {}, {}
    for mode in args.modes:
        for beam in args.beam_sizes:
            for compiled in (False, True):
                key = (mode, beam, "compiled" if compiled else "eager")
                fn, clock = build(mode, beam, compiled, args.threads)
                t0 = time.perf_counter()
                fn(audios[0])  # compiles the shape of one clip (compiled engines)
                compile_s[key] = time.perf_counter() - t0
                configs[key] = (fn, clock)
    rows = {k: {"enc": [], "step": [], "total": []} for k in configs}
    for _ in range(args.rounds):
        for key, (fn, clock) in configs.items():
            clock.reset()
            t0 = time.perf_counter()
            texts[key] = [fn(a) for a in audios]
            rows[key]["total"].append(time.perf_counter() - t0)
            rows[key]["enc"].append(statistics.median(clock.encode_s))
            rows[key]["step"].append(statistics.median(clock.decode_s))
    print("| mode | beam | decode | first clip s (compile) | total s | encoder ms | "
          "decode ms/step | host share (profiled wall) | host share (unprofiled wall) | "
          "text = eager |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, (fn, clock) in configs.items():
        r = {k: statistics.median(v) for k, v in rows[key].items()}
        profiled, plain = host_shares(lambda fn=fn: fn(audios[0]), clock)
        eager = texts[(key[0], key[1], "eager")]
        same = sum(a == b for a, b in zip(texts[key], eager, strict=True))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {compile_s[key]:.1f} | {r['total']:.2f} | "
              f"{r['enc'] * 1e3:.0f} | {r['step'] * 1e3:.2f} | {profiled:.0%} | {plain:.0%} | "
              f"{same}/{len(audios)} |")


if __name__ == "__main__":
    main()
