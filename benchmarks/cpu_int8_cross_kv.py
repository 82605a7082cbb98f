"""CPU, ``--quantization int8``: the cross K/V projection as int8 (now) vs float32 (before).

One int8 engine (embedded tiny.en, beam 5, 2 threads); rounds alternate the decoder's
``cross_kv_layers`` (the per-layer int8 GEMMs) with the stacked float32 GEMM (attribute set to
None) over every clip of ``benchmarks/cpu_whisper.py``; prints each mode's total seconds per
round and the clips whose text differs.

  python benchmarks/cpu_int8_cross_kv.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_whisper as cw  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from edserve.audio.decode import load_audio
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    engine = build_engine(device="cpu", threads=args.threads, max_running_requests=5,
                          quantization="int8")
    decoder = engine.model.model.decoder
    int8_layers = decoder.cross_kv_layers
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False, beam_size=5)
    paths = cw.clips()
    audios = [load_audio(str(p)) for p in paths]
    transcribe(engine, [audios[0]], options=opts)  # warm-up
    totals: dict[str, list[float]] = {"int8": [], "float32": []}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for mode in ("int8", "float32") if r % 2 == 0 else ("float32", "int8"):
            decoder.cross_kv_layers = int8_layers if mode == "int8" else None
            start = time.perf_counter()
            texts[mode] = [transcribe(engine, [a], options=opts)[0].text for a in audios]
            totals[mode].append(time.perf_counter() - start)
    print(f"# {len(paths)} clips, beam 5, {args.threads} threads; total s per round:")
    for mode, t in totals.items():
        print(f"{mode:8s} " + " ".join(f"{x:.2f}" for x in t))
    for p, a, b in zip(paths, texts["int8"], texts["float32"], strict=True):
        if a != b:
            print(f"{p.name}: int8 {a!r}\n{'':{len(p.name) + 2}}fp32 {b!r}")


if __name__ == "__main__":
    main()
