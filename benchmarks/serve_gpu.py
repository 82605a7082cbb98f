"""``edserve serve`` end to end vs the engine on the same requests (issue 18's protocol).

Saves a random-weight HF Whisper folder (large-v3 shapes, the tiny.en tokenizer), measures the
engine-level figure (``Engine.generate``: every request of a short clip submitted at once, the
transcription filters on, 17 new tokens per window, fallback off), then starts ``edserve
serve`` on the same folder (``--max-running-requests 64``, ``--context-length 34``: windows of
at most 17 new tokens, fallback thresholds off) and drives it with ``edserve bench``'s client at
each concurrency on ``tests/data/jfk.wav`` (json responses), plus long-form: concurrent
10-minute files made by tiling the test clips, against the in-process transcription driver on
the same files. Prints the ratios, each level's share of the floor (``whisper_gpu.floor_seconds``
at that concurrency: encoder FLOPs at the measured matmul rate, decode steps' weights and K/V
at the copy rate), the server's stage breakdown, CPU time per request by role (the API
process, the audio workers, the engine's stepping thread with its busy share of the run, the
rest of an engine process), the GPU's busy share during each level (``gpu_busy.py``: NVML's
utilization, the engine being in another process), the language guesses right and wrong, and
writes a JSON summary. ``--serve-flags`` (repeatable) measures server variants in one run;
``--py-spy-target engine`` profiles the stepping process; ``--bench-field`` adds form fields.

  python benchmarks/serve_gpu.py --json /tmp/out/serve_gpu.json          # H200
  python benchmarks/serve_gpu.py --dry-run                               # toy model, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyspy_top
import torch
import whisper_gpu as wg
from gpu_busy import GpuBusy
from proc_stats import cpu_delta, cpu_figures, engine_pid, thread_cpu

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(  # the server subprocess runs this checkout too
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

from edserve.audio.decode import load_audio  # noqa: E402
from edserve.bench.client import BenchTarget, LoadPlan, run_load  # noqa: E402
from edserve.bench.load import AudioItem  # noqa: E402
from edserve.bench.report import (  # noqa: E402
    scrape,
    scrape_guesses,
    stage_delta,
    step_delta,
    summarize,
)

DATA = ROOT / "tests" / "data"
CONTEXT = 34  # decoder positions: n_ctx // 2 = 17 new tokens per window
NO_FALLBACK = ("--compression-ratio-threshold", "inf", "--logprob-threshold=-inf",
               "--no-speech-threshold", "inf")


def save_folder(arch: str, folder: Path, device: str, dtype: torch.dtype | None = None) -> Path:
    """A random-weight HF Whisper folder with the tiny.en tokenizer (bf16 on CUDA unless
    ``dtype`` says otherwise)."""
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = wg.build_hf(arch, device, dtype)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(wg.tokenizer_path(), folder / "tokenizer.json")
    del model
    return folder


def options():
    from edserve.whisper.options import TranscribeOptions

    # the server's options for a json request at temperature 0 with the thresholds off
    return TranscribeOptions(temperatures=(0.0,), compression_ratio_threshold=None,
                             logprob_threshold=None, no_speech_threshold=None)


def engine_figures(folder: Path, clip: np.ndarray, n_short: int, long_audio: list[np.ndarray],
                   rows: int, extra: dict) -> dict[str, float]:
    """Engine.generate on ``n_short`` first-window requests of ``clip`` (requests/s), and the
    in-process driver on the long files (audio seconds/s)."""
    from edserve.runtime import build_engine
    from edserve.whisper.language import LanguageGuess
    from edserve.whisper.transcribe import make_task, run_tasks

    engine = build_engine(model=str(folder), max_running_requests=rows, context_length=CONTEXT,
                    **extra)
    dev = str(engine.device)

    guess = LanguageGuess()  # shared, as the server shares one: learnt in the warm-up

    def short_run(engine, n: int, label: str) -> float:
        tasks = [make_task(engine, clip, options(), "clip", guess) for _ in range(n)]
        reqs = [t.next_request() for t in tasks]
        wg.sync(dev)
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        wg.sync(dev)
        took = time.perf_counter() - t0
        assert all(o.error is None for o in outs), outs[0].error
        for t, o in zip(tasks, outs, strict=True):  # the guess learns; handles go back
            t.feed(o)
            for h in t.abandon():
                engine.release_encoder(h)
        if any(not o.token_ids for o in outs):
            print(f"# engine figure, {label}: {sum(not o.token_ids for o in outs)} of {n} "
                  "windows guessed the language wrong (each ends after its prefill)", flush=True)
        return took

    short_run(engine, min(n_short, rows), "warm-up")
    short_s = short_run(engine, n_short, "measured")
    t_feat = time.perf_counter()  # the log-mels of the long files (one thread, as transcribe)
    tasks = [make_task(engine, a, options(), f"long{i}") for i, a in enumerate(long_audio)]
    features_s = time.perf_counter() - t_feat
    wg.sync(dev)
    t0 = time.perf_counter()
    run_tasks(engine, tasks)
    wg.sync(dev)
    long_s = time.perf_counter() - t0
    engine.check_integrity()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"requests_per_s": n_short / short_s, "short_s": short_s,
            "longform_audio_s_per_s": sum(len(a) for a in long_audio) / 16000 / long_s
            if long_audio else float("nan"),
            "longform_s": long_s, "longform_features_s": features_s,
            "longform_audio_s_per_s_with_features":
            sum(len(a) for a in long_audio) / 16000 / (long_s + features_s)
            if long_audio else float("nan")}


def long_files(folder: Path, n: int, seconds: float) -> list[tuple[Path, np.ndarray]]:
    """``n`` WAV files of ``seconds`` each: the test clips tiled with 0.5 s pauses (each file
    starts at a different clip so the windows differ)."""
    from tests.server.server_helpers import wav_bytes

    clips = [load_audio(DATA / f"{c}.wav") for c in ("jfk", "librivox_0870", "cards_005")]
    pause = np.zeros(8000, dtype=np.float32)
    out = []
    for i in range(n):
        parts, total, k = [], 0, i
        while total < seconds * 16000:
            parts += [clips[k % 3], pause]
            total += len(clips[k % 3]) + len(pause)
            k += 1
        audio = np.concatenate(parts)[:int(seconds * 16000)]
        path = folder / f"long{i}.wav"
        path.write_bytes(wav_bytes(audio))
        out.append((path, load_audio(path)))  # what the server will see (16-bit rounding)
    return out


def bench(url: str, items: list[AudioItem], concurrency: int, pid: int,
          fields: tuple[tuple[str, str], ...] = ()) -> dict:
    target = BenchTarget(url, timeout=1800, fields=fields)
    (before, steps0), cpu0, guesses0 = scrape(url), thread_cpu(pid), scrape_guesses(url)
    client0 = time.process_time()
    with GpuBusy() as busy:  # the driver's view: the engine may be in another process
        results, wall = asyncio.run(run_load(target, LoadPlan(items, concurrency)))
    client_cpu = time.process_time() - client0
    cpu = cpu_delta(cpu0, thread_cpu(pid))
    after, steps1 = scrape(url)
    s = summarize(results, wall, {"concurrency": concurrency, "num_requests": len(items)},
                  stage_delta(before, after), step_delta(steps0, steps1, wall), client_cpu)
    s.update(cpu_figures(cpu, len(items), wall))
    guesses1 = scrape_guesses(url)
    s["language_guesses"] = None if guesses0 is None or guesses1 is None else \
        {k: int(v - guesses0.get(k, 0.0)) for k, v in guesses1.items()}
    s["gpu_busy"] = busy.share
    return s


def serve_figures(args, flags: str, work: Path, folder: Path, clip_path: Path,
                  clip: np.ndarray, longs: list, eng: dict, extra: dict) -> dict:
    """One server (``edserve serve`` + ``flags``): every concurrency level, then long-form."""
    from tests.server.server_helpers import start_server

    device = "cpu" if args.dry_run else "cuda"
    env = None
    if flags.startswith("tree="):  # another checkout's server (an A/B of two trees)
        tree, _, flags = flags[5:].partition(" ")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(tree).resolve()), os.environ["PYTHONPATH"]])}
    proc, url = start_server(work / "serve.log", "--model", str(folder), "--device", device,
                             "--max-running-requests", str(args.rows), "--context-length",
                             str(CONTEXT), *NO_FALLBACK, *flags.split(),
                             *(f"--{k.replace('_', '-')}={v}" for k, v in extra.items()),
                             env=env)
    out: dict = {"serve": {}}
    try:
        short = AudioItem("jfk.wav", clip_path.read_bytes(), len(clip) / 16000)
        fields = tuple(tuple(f.split("=", 1)) for f in args.bench_field)
        bench(url, [short] * max(8, args.rows), min(8, args.rows), proc.pid, fields)  # warm-up
        print("conc  req/s  x engine  %floor  p50 ms  p99 ms  api CPU ms/req  audio CPU ms/req  "
              "failed", flush=True)
        for c in args.concurrency:
            spied = engine_pid(proc.pid) if args.py_spy_target == "engine" else proc.pid
            spy = pyspy_top.record(spied, args.py_spy, work / "serve.spy") \
                if args.py_spy and c == (args.py_spy_at or max(args.concurrency)) else None
            s = bench(url, [short] * args.requests, c, proc.pid, fields)
            if spy is not None:
                _, err = spy.communicate(timeout=args.py_spy + 60)
                if (work / "serve.spy").is_file():
                    pyspy_top.top(work / "serve.spy")
                else:
                    print(f"# py-spy failed: {err.strip()[-300:]}")
            s["ratio_to_engine"] = s["requests_per_s"] / eng["requests_per_s"]
            rows = min(c, args.rows)  # in flight at once: the server runs at most --rows
            s["floor_requests_per_s"] = rows / wg.floor_seconds(args.arch, rows, CONTEXT // 2,
                                                                *eng["ceilings"])
            out["serve"][str(c)] = s
            lat = s["latency_ms"] or {"p50": float("nan"), "p99": float("nan")}
            print(f"{c:4d}  {s['requests_per_s']:5.1f}  {s['ratio_to_engine']:8.2f}  "
                  f"{100 * s['requests_per_s'] / s['floor_requests_per_s']:6.1f}  "
                  f"{lat['p50']:6.0f}  {lat['p99']:6.0f}  {s['api_cpu_ms_per_request']:14.2f}  "
                  f"{s['helpers_cpu_ms_per_request']:16.2f}  {s['failed']}", flush=True)
            for stage, d in (s["stages"] or {}).items():
                print(f"#   {stage:12s} {d['mean_ms']:9.2f} ms (n={d['count']})")
            print(f"#   engine thread CPU {s['engine_cpu_ms_per_request']:.2f} ms/req (busy "
                  f"{100 * s['engine_thread_busy']:.0f} % of the run), rest of the engine "
                  f"process {s['engine_proc_cpu_ms_per_request']:.2f} ms/req; client "
                  f"{s['client_cpu_ms_per_request']:.2f} ms/req, busy "
                  f"{100 * s['client_busy']:.0f} % of a core")
            if s["gpu_busy"] is not None:
                print(f"#   GPU busy {100 * s['gpu_busy']:.0f} % of the level (NVML "
                      "utilization, 100 ms samples)")
            if s["language_guesses"]:  # a wrong guess: a second prefill for its window
                print(f"#   language guesses: right {s['language_guesses'].get('right', 0)}, "
                      f"wrong {s['language_guesses'].get('wrong', 0)}")
            for kind, d in (s["engine_steps"] or {}).items():
                print(f"#   steps {kind:8s} {d['steps_per_s']:7.1f}/s {d['ms_per_step']:7.2f} ms "
                      f"rows {d['rows_per_step']:5.1f} new {d['new_rows_per_step']:5.1f} "
                      f"({100 * d['share']:.0f} % of the run); device "
                      f"{d['device_ms_per_step']:.2f} ms, GPU idle before "
                      f"{d['gap_ms_per_step']:.2f}, host wait "
                      f"{d['wait_ms_per_step']:.2f}", flush=True)
            steps = s["engine_steps"] or {}
            busy, late = (sum(d["steps_per_s"] * d[k] for d in steps.values()) / 1e3
                          for k in ("device_ms_per_step", "gap_ms_per_step"))
            if busy:  # CUDA: the step events' device seconds per second of the level
                print(f"#   device busy {100 * busy:.0f} % of the level by the steps' events, "
                      f"idle before steps {100 * late:.1f} %", flush=True)
        items = [AudioItem(p.name, p.read_bytes(), len(a) / 16000) for p, a in longs]
        if not items:  # --longform 0
            return out
        s = bench(url, items, len(items), proc.pid)
        s["ratio_to_engine"] = s["audio_seconds_per_s"] / eng["longform_audio_s_per_s"]
        out["longform"] = s
        with_features = eng["longform_audio_s_per_s_with_features"]
        s["ratio_to_engine_with_features"] = s["audio_seconds_per_s"] / with_features
        print(f"long-form x{len(items)} {args.longform_seconds:.0f} s: "
              f"{s['audio_seconds_per_s']:.0f} audio s/s = {s['ratio_to_engine']:.2f} x engine "
              f"({eng['longform_audio_s_per_s']:.0f}; its log-mels, computed before its clock, "
              f"took {eng['longform_features_s']:.2f} s: {with_features:.0f} with them, "
              f"{s['ratio_to_engine_with_features']:.2f} x); failed {s['failed']} "
              f"{s.get('errors') or ''}", flush=True)
        print(f"#   long-form API CPU {s['api_cpu_ms_per_request']:.1f} ms/req, p50 "
              f"{(s['latency_ms'] or {}).get('p50', float('nan')):.0f} ms; stages (mean ms): "
              + ", ".join(f"{k} {d['mean_ms']:.1f}" for k, d in (s["stages"] or {}).items()),
              flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64, 128])
    ap.add_argument("--requests", type=int, default=256, help="short-clip requests per level")
    ap.add_argument("--longform", type=int, default=16, help="concurrent long files (0: none)")
    ap.add_argument("--longform-seconds", type=float, default=600.0)
    ap.add_argument("--rows", type=int, default=64, help="--max-running-requests")
    ap.add_argument("--serve-flags", action="append", default=[],
                    help="a server variant: more `edserve serve` flags, given with '=', e.g. "
                    "--serve-flags='--audio-workers 0' (decode in API threads, as before) or "
                    "--serve-flags=--engine-process (--serve-flags= : the defaults); repeat to "
                    "measure several servers against the one engine figure (default: one "
                    "server, default flags); 'tree=DIR flags...' runs that server from the "
                    "checkout in DIR (first on its PYTHONPATH: an A/B of two trees)")
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="S",
                    help="profile a process (--py-spy-target) with py-spy for S seconds during the "
                    "level --py-spy-at (py-spy on PATH)")
    ap.add_argument("--py-spy-at", type=int, default=0, metavar="C",
                    help="the concurrency level profiled (default: the highest)")
    ap.add_argument("--py-spy-target", choices=("api", "engine"), default="api",
                    help="the process py-spy samples: the API process, or the one that steps "
                    "the engine (the engine process by default on CUDA; the API process when "
                    "the engine runs in it)")
    ap.add_argument("--fp8", action="store_true",
                    help="the engine figure and every server with --encoder-dtype fp8 "
                    "--kv-cache-dtype fp8")
    ap.add_argument("--bench-field", action="append", default=[], metavar="K=V",
                    help="an extra form field on every short-clip request (repeatable), e.g. "
                    "language=en (no language detection, so no guess)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="toy model on the CPU, few requests")
    args = ap.parse_args()
    device, extra = "cuda", {}
    if args.dry_run:  # one torch thread: two oversubscribe a shared 2-core box (8x slower)
        device, args.arch, args.concurrency, args.requests = "cpu", "toy", [1, 2], 4
        args.longform, args.longform_seconds, args.rows, extra = 2, 40.0, 4, {"threads": 1}

    if args.fp8:
        extra = {**extra, "encoder_dtype": "fp8", "kv_cache_dtype": "fp8"}  # server too
    work = Path(tempfile.mkdtemp(prefix="serve_gpu_"))
    folder = save_folder(args.arch, work / "model", device)
    clip_path = DATA / "jfk.wav"
    clip = load_audio(clip_path)
    longs = long_files(work, args.longform, args.longform_seconds)
    ceilings = wg.ceilings(device)
    for rows in sorted({min(c, args.rows) for c in args.concurrency}):
        print(f"# {wg.short_floor(args.arch, rows, CONTEXT // 2, *ceilings)}", flush=True)
    eng = engine_figures(folder, clip, args.requests, [a for _, a in longs], args.rows, extra)
    eng["ceilings"] = ceilings
    print(f"# engine: {eng['requests_per_s']:.1f} short requests/s, long-form "
          f"{eng['longform_audio_s_per_s']:.0f} audio s/s", flush=True)
    gc.collect()  # the engine's pools and graphs go before the server sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"# GPU memory still held here: {torch.cuda.memory_allocated() / 2**30:.1f} GiB",
              flush=True)
    summary = {"arch": args.arch, "device": device, "fp8": args.fp8, "engine": eng,
               "variants": {}}
    for flags in args.serve_flags or [""]:
        print(f"## edserve serve {flags or '(defaults)'}", flush=True)
        summary["variants"][flags] = serve_figures(args, flags, work, folder, clip_path, clip,
                                                   longs, eng, extra)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
