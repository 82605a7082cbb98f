"""CPU Whisper benchmark: edserve (fp32, bf16, int8) vs faster-whisper (int8, float32) vs HF fp32.

One model (the embedded tiny.en CTranslate2 folder for all systems; HF gets
edserve's loader state dict in float32), greedy (``--beam-size 1``, the default) or beam search
with ``--beam-size N`` for every system, temperature 0, no timestamps,
English, same thread count. Every clip of ``tests/data`` and ``../shared/assets`` (same name
counted once) is transcribed one at a time from its decoded 16 kHz waveform (each system does
its own log-mel; HF uses edserve's). Rounds interleave the systems, so a shared machine's load
hits all of them alike; the tables give medians over rounds. Each system runs in a fresh
process per round (``--isolation process``, the default): CTranslate2 and torch each bring an
OpenMP runtime, and in one process whichever system ran after the other was measured up to
1.75x slower (``--isolation shared`` keeps the old one-process protocol).

Reported per system: start-up (model load + first transcription), total wall over all clips,
median per-clip wall, tokens/s (output tokens of the tiny.en tokenizer / total wall), WER
against ``../shared/assets/README.md`` references (clips that have one), and clips whose text
equals edserve fp32's. ``--cli`` also times the whole command line as a user runs it
(process start included; ``benchmarks/cpu_cli.py``): ``edserve transcribe FILES...`` vs a
faster-whisper loop script, greedy and beam 5. Per-step timings (encoder, decode step, host
share, eager vs compiled): ``benchmarks/cpu_step.py``.

  python benchmarks/cpu_whisper.py [--rounds 3] [--threads 2] [--cli] [--systems ...]
  python benchmarks/cpu_whisper.py --beam-size 5 --rounds 1     # beam search, all systems
  python benchmarks/cpu_whisper.py --clips 1 ...                # only the first clip (a check)

faster-whisper and transformers are optional: systems whose package is missing are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA, ASSETS = ROOT / "tests" / "data", ROOT.parent / "shared" / "assets"
SYSTEMS = ("edserve-fp32", "edserve-bf16", "edserve-int8", "fw-int8", "fw-fp32", "hf-fp32")
_NUM = "zero one two three four five six seven eight nine ten eleven twelve".split()


def clips() -> list[Path]:
    seen: dict[str, Path] = {}
    for folder in (DATA, ASSETS):
        for p in sorted(folder.glob("*.wav")):
            seen.setdefault(p.name, p)
    return list(seen.values())


def references(folders: tuple[Path, ...] = (ASSETS,)) -> dict[str, str]:
    """``file.wav`` -> reference transcript, from the README tables of ``folders`` (the first
    folder naming a file wins)."""
    refs: dict[str, str] = {}
    for readme in (f / "README.md" for f in folders):
        if readme.is_file():
            for m in re.finditer(r"^\| (\S+\.wav) \([^)]*\) \| ([^|]+) \|", readme.read_text(),
                                 re.M):
                refs.setdefault(m.group(1), m.group(2).strip())
    return refs


def normalize(text: str) -> list[str]:
    """Lower case, no punctuation (any script's letters kept), hyphens split, small numbers
    spelled out."""
    words = re.sub(r"[^\w' ]|_", " ", text.lower().replace("-", " ")).split()
    return [_NUM[int(w)] if w.isdigit() and int(w) < len(_NUM) else w.strip("'")
            for w in words]


def word_errors(ref: str, hyp: str) -> tuple[int, int]:
    """(edit distance in words, reference words)."""
    r, h = normalize(ref), normalize(hyp)
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)], len(r)


def make_system(name: str, threads: int, model_dir: str, beam_size: int = 1,
                beam_on_device: bool = False):
    """-> transcribe(audio float32 16 kHz) -> text, or None when the package is missing."""
    if name.startswith("edserve"):
        from edserve.runtime import build_engine
        from edserve.whisper.options import TranscribeOptions
        from edserve.whisper.transcribe import transcribe

        mode = name.split("-")[1]
        engine = build_engine(device="cpu", threads=threads, max_running_requests=beam_size,
                        dtype={"bf16": "bfloat16"}.get(mode, "float32"),
                        quantization="int8" if mode == "int8" else "none",
                        beam_on_device=beam_on_device)
        opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                                 beam_size=beam_size)
        return lambda audio: transcribe(engine, [audio], options=opts)[0].text
    if name.startswith("fw"):
        try:
            from faster_whisper import WhisperModel
        except ImportError:
            return None
        model = WhisperModel(model_dir, device="cpu", cpu_threads=threads,
                             compute_type={"fw-int8": "int8", "fw-fp32": "float32"}[name])

        def fw(audio):
            segs, _ = model.transcribe(audio, beam_size=beam_size, without_timestamps=True,
                                       temperature=0.0, language="en", vad_filter=False,
                                       condition_on_previous_text=False)
            return "".join(s.text for s in segs).strip()
        return fw
    return hf_system(beam_size)


def hf_system(beam_size: int = 1):
    try:
        from transformers import WhisperConfig, WhisperForConditionalGeneration
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.set_verbosity_error()
    import torch

    from edserve.audio.mel import whisper_features
    from edserve.models.weights import load_checkpoint
    from edserve.tokenizer import WhisperTokenizer

    ckpt = load_checkpoint(None)
    model = WhisperForConditionalGeneration(WhisperConfig(**ckpt.config)).eval()
    model.load_state_dict({k: v.float() for k, v in ckpt.state_dict.items()}, strict=False)
    model.tie_weights()
    tok = WhisperTokenizer.from_file(ckpt.tokenizer_path, vocab_size=ckpt.config["vocab_size"])
    prompt = torch.tensor([[tok.sot, tok.no_timestamps]])

    def hf(audio):
        feats = whisper_features(audio, 80)[None]
        with torch.inference_mode():
            out = model.generate(input_features=feats, decoder_input_ids=prompt,
                                 max_new_tokens=200, do_sample=False, num_beams=beam_size,
                                 eos_token_id=tok.eot, pad_token_id=tok.eot)
        ids = [t for t in out[0].tolist() if t < tok.eot]  # prompt/specials are > eot
        return tok.decode(ids).strip()
    return hf


def _decode(args, paths: list[Path]) -> list:
    """The clips as float32 16 kHz arrays (this process's torch threads set first)."""
    import numpy as np
    import torch

    from edserve.audio.decode import load_audio

    torch.set_num_threads(args.threads)
    return [load_audio(p).astype(np.float32) for p in paths]


def _load(name: str, args, audios: list):
    """(transcribe fn or None, start-up s: model load + the first clip)."""
    from edserve.models.weights import default_model_folder

    t0 = time.perf_counter()
    fn = make_system(name, args.threads, str(default_model_folder()), args.beam_size,
                     args.beam_on_device)
    if fn is not None:
        fn(audios[0])
    return fn, time.perf_counter() - t0


def _one_round(fn, audios) -> tuple[list[float], list[str]]:
    times, out = [], []
    for audio in audios:
        t0 = time.perf_counter()
        out.append(fn(audio))
        times.append(time.perf_counter() - t0)
    return times, out


def worker(args, paths: list[Path]) -> None:
    """``--worker NAME``: one system in this process, one round; a JSON line on stdout."""
    audios = _decode(args, paths)
    fn, startup = _load(args.worker, args, audios)
    if fn is None:
        print(json.dumps(None))
        return
    times, texts = _one_round(fn, audios)
    print(json.dumps({"startup": startup, "times": times, "texts": texts}))


def run_systems(args, paths: list[Path]) -> None:
    """Every round runs every system once, interleaved. ``--isolation process`` (default):
    each system in a fresh process per round (faster-whisper's CTranslate2 and torch bring
    two OpenMP runtimes; in one process, whichever runs after the other was measured up to
    1.75x slower); ``shared``: all systems in this process, as before."""
    from edserve.models.weights import load_checkpoint
    from edserve.tokenizer import WhisperTokenizer

    ckpt = load_checkpoint(None)
    tok = WhisperTokenizer.from_file(ckpt.tokenizer_path, vocab_size=ckpt.config["vocab_size"])
    startups: dict[str, list[float]] = {}
    times: dict[str, list[list[float]]] = {}
    texts: dict[str, list[str]] = {}
    loaded = {}
    if args.isolation == "shared":
        audios = _decode(args, paths)
        for name in args.systems:
            fn, startup = _load(name, args, audios)
            if fn is None:
                print(f"# {name}: package missing, skipped")
                continue
            loaded[name], startups[name] = fn, [startup]
    for _ in range(args.rounds):
        for name in args.systems:
            if args.isolation == "shared":
                if name not in loaded:
                    continue
                ts, out = _one_round(loaded[name], audios)
            else:
                cmd = [sys.executable, __file__, "--worker", name, "--threads",
                       str(args.threads), "--beam-size", str(args.beam_size),
                       *(["--clips", str(args.clips)] if args.clips else []),
                       *(["--beam-on-device"] if args.beam_on_device else [])]
                res = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                                check=True).stdout.splitlines()[-1])
                if res is None:
                    print(f"# {name}: package missing, skipped")
                    continue
                startups.setdefault(name, []).append(res["startup"])
                ts, out = res["times"], res["texts"]
            for i, t in enumerate(ts):
                times.setdefault(name, [[] for _ in paths])[i].append(t)
            texts[name] = out
    startup = {n: statistics.median(v) for n, v in startups.items()}
    report(args, paths, [n for n in args.systems if n in times], startup, times, texts, tok)


def report(args, paths, systems, startup, times, texts, tok) -> None:
    refs = references()
    base = texts.get("edserve-fp32")
    print(f"# {len(paths)} clips ({sum(1 for p in paths if p.name in refs)} with references), "
          f"threads {args.threads}, beam size {args.beam_size}, medians of {args.rounds} "
          f"interleaved rounds, {args.isolation} isolation")
    print("| system | start-up s | total s | per-clip median s | tokens/s | WER % | "
          "= edserve fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in systems:
        total = statistics.median(sum(ts[r] for ts in times[name]) for r in range(args.rounds))
        clip_med = statistics.median(statistics.median(ts) for ts in times[name])
        ntok = sum(len(tok.encode(" " + t)) + 1 for t in texts[name])  # + end of text
        err = [word_errors(refs[p.name], t) for p, t in zip(paths, texts[name], strict=True)
               if p.name in refs]
        wer = 100 * sum(e for e, _ in err) / max(1, sum(n for _, n in err))
        same = sum(a == b for a, b in zip(texts[name], base, strict=True)) if base else 0
        print(f"| {name} | {startup[name]:.2f} | {total:.2f} | {clip_med:.3f} | "
              f"{ntok / total:.0f} | {wer:.1f} | {same}/{len(paths)} |")
    if args.texts:
        for i, p in enumerate(paths):
            print(f"\n{p.name}: ref {refs.get(p.name)!r}")
            for name in systems:
                print(f"  {name:13s} {texts[name][i]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--cli", action="store_true", help="also time the command lines")
    ap.add_argument("--no-systems", action="store_true", help="only the command lines")
    ap.add_argument("--texts", action="store_true", help="print every system's text")
    ap.add_argument("--beam-size", type=int, default=1,
                    help="beam search width for every system (1: greedy, today's default)")
    ap.add_argument("--beam-on-device", action="store_true",
                    help="edserve chooses beams on the device (fixed rows per beam group)")
    ap.add_argument("--clips", type=int, default=None, help="only the first N clips")
    ap.add_argument("--isolation", choices=("process", "shared"), default="process",
                    help="process: every system in a fresh process per round (default); "
                    "shared: all in this one (the OpenMP runtimes of torch and CTranslate2 "
                    "then slow each other)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads is None:
        from edserve.engine.cpu_modes import physical_cores

        args.threads = physical_cores()
    paths = clips()[:args.clips]
    if args.worker:
        worker(args, paths)
        return
    from cpu_step import cpu_description

    print(f"# {cpu_description()}")
    if not args.no_systems:
        run_systems(args, paths)
    if args.cli or args.no_systems:
        from cpu_cli import run_cli

        run_cli(args.rounds, args.threads, paths)


if __name__ == "__main__":
    main()
