"""Accuracy cost of the fp8 options (and ``--encoder-gelu tanh``) on real speech: token agreement
with the default and WER.

Per model (``tiny.en``: embedded; ``base``: the [base] extra) and per mode (default; encoder
fp8; KV cache fp8; both; the encoder MLPs' GELU in its tanh form), every clip of
``tests/data`` and ``../shared/assets`` is transcribed one at a time with
``Engine.transcribe``'s defaults (greedy at temperature 0, fallback on). Reported per mode:
clips whose tokens equal the default's, token agreement (tokens matched by a ``difflib``
alignment / the default's tokens), and the WER against the references of
``../shared/assets/README.md`` (clips that have one). On CPU fp8 is emulated (same rounding as
``torch._scaled_mm``'s inputs, products in float32), so the figures hold for the GPU path up to
accumulation order.

  python benchmarks/fp8_accuracy.py [--models tiny.en base] [--dtype float32]
  python benchmarks/fp8_accuracy.py --device cuda --dtype bfloat16   # on an fp8 GPU
  python benchmarks/fp8_accuracy.py --modes default "gelu tanh" --dtype float32
"""

from __future__ import annotations

import argparse
import difflib
import time

import cpu_whisper as cw

from edserve.audio.decode import load_audio
from edserve.engine.engine import Engine
from edserve.runtime import build_engine
from edserve.whisper.transcribe import transcribe as run_transcribe

MODES = {
    "default": {},
    "encoder fp8": {"encoder_dtype": "fp8"},
    "KV fp8": {"kv_cache_dtype": "fp8"},
    "both fp8": {"encoder_dtype": "fp8", "kv_cache_dtype": "fp8"},
    "gelu tanh": {"encoder_gelu": "tanh"},
}


def transcribe(engine: Engine, audios: list) -> list[tuple[str, list[int]]]:
    """(text, tokens) per clip, one at a time."""
    out = []
    for audio in audios:
        [t] = run_transcribe(engine, [audio], temperature=0.0)
        toks = [tok for s in t.segments for tok in s.tokens]
        out.append((t.text, toks))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny.en", "base"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clips", type=int, default=None, help="only the first N clips")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="modes to run (the first is the one the others are compared with)")
    args = ap.parse_args()
    paths = cw.clips()[:args.clips]
    refs = cw.references()
    audios = [load_audio(str(p)) for p in paths]
    print(f"# {len(paths)} clips ({sum(len(a) for a in audios) / 16000:.0f} s), device "
          f"{args.device}, dtype {args.dtype}; WER over the {sum(p.name in refs for p in paths)} "
          "referenced clips")
    print("| model | mode | clips = default | token agreement | WER % | wall s |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        base_out = None
        for mode in args.modes:
            kw = MODES[mode]
            engine = build_engine(model=model, device=args.device, dtype=args.dtype, **kw)
            t0 = time.perf_counter()
            out = transcribe(engine, audios)
            wall = time.perf_counter() - t0
            base_out = base_out or out
            same = sum(o[1] == b[1] for o, b in zip(out, base_out, strict=True))
            match = total = 0
            for (_, toks), (_, ref) in zip(out, base_out, strict=True):
                sm = difflib.SequenceMatcher(a=ref, b=toks, autojunk=False)
                match += sum(b.size for b in sm.get_matching_blocks())
                total += len(ref)
            err = [cw.word_errors(refs[p.name], o[0]) for p, o in zip(paths, out, strict=True)
                   if p.name in refs]
            wer = 100 * sum(e for e, _ in err) / max(1, sum(n for _, n in err))
            print(f"| {model} | {mode} | {same}/{len(paths)} | {100 * match / max(1, total):.1f} %"
                  f" | {wer:.1f} | {wall:.1f} |", flush=True)
            for p, (text, _), (btext, _) in zip(paths, out, base_out, strict=True):
                if text != btext:
                    print(f"|   | {p.name}: {text!r} (default {btext!r}) | | | | |")


if __name__ == "__main__":
    main()
