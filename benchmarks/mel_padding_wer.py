"""WER of the two window layouts (``--mel-padding silence`` vs ``zeros``) on every labelled clip.

Clips: every WAV of ``../shared/assets`` and ``tests/data`` that its README gives a reference
transcript for (a name in both folders counted once), plus synthesized long-form audio: the
English clips joined end to end with pauses (references joined with spaces), so that the last
window of each is shorter than 30 s. English-only tiny.en is scored on the English clips;
base (multilingual, language detected) on all of them. Each configuration transcribes every
clip in one batch, as ``edserve transcribe`` does: temperature 0 with the fallback schedule,
``best_of`` 5, no timestamps for clips under 30 s; greedy (``beam_size`` 1) and beam 5.

WER: word edit distance over reference words, summed over clips (``cpu_whisper.normalize``:
lower case, punctuation removed, numbers up to 12 spelled out).

  python benchmarks/mel_padding_wer.py [--models tiny.en base] [--beams 1 5] [--texts]
  python benchmarks/mel_padding_wer.py --models tiny.en --beams 1 --clips 2   # a quick check
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from cpu_whisper import ASSETS, DATA, references, word_errors

from edserve.config import MEL_PADDINGS

NON_ENGLISH = ("espeak_",)  # clip name prefixes that are not English speech
# (name, clip stems in order, pause seconds between clips, repeats)
LONG_FORM = (("long_forward", None, 1.0, 1), ("long_reversed_x2", "reversed", 0.3, 2))


def labelled_clips() -> dict[str, tuple[Path, str]]:
    """``stem`` -> (path, reference) for every clip with a reference transcript."""
    refs = references((ASSETS, DATA))
    out: dict[str, tuple[Path, str]] = {}
    for folder in (ASSETS, DATA):
        for p in sorted(folder.glob("*.wav")):
            if p.name in refs:
                out.setdefault(p.stem, (p, refs[p.name]))
    return out


def long_form(audios: dict[str, np.ndarray], refs: dict[str, str]
              ) -> dict[str, tuple[np.ndarray, str]]:
    """English clips joined (with pauses) into audio over 30 s, references joined."""
    english = [n for n in audios if not n.startswith(NON_ENGLISH)]
    out = {}
    for name, order, pause, repeats in LONG_FORM:
        names = (english[::-1] if order == "reversed" else english) * repeats
        gap = np.zeros(int(16000 * pause), np.float32)
        audio = np.concatenate([x for n in names for x in (audios[n], gap)])
        out[name] = (audio, " ".join(refs[n] for n in names))
    return out


def run(model: str, beam: int, padding: str, audios: list[np.ndarray]) -> list[str]:
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    engine = build_engine(model=model, device="cpu", max_running_requests=len(audios) * 5)
    opts = TranscribeOptions(beam_size=beam, best_of=5, mel_padding=padding)
    return [r.text for r in transcribe(engine, audios, options=opts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny.en", "base"])
    ap.add_argument("--beams", nargs="+", type=int, default=[1, 5])
    ap.add_argument("--clips", type=int, default=None, help="only the first N short clips")
    ap.add_argument("--texts", action="store_true", help="print texts where layouts differ")
    args = ap.parse_args()
    from edserve.audio.decode import load_audio

    labelled = dict(list(labelled_clips().items())[:args.clips])
    audios = {n: load_audio(p) for n, (p, _) in labelled.items()}
    refs = {n: r for n, (_, r) in labelled.items()}
    longs = long_form(audios, refs)
    items = {**{n: (a, refs[n]) for n, a in audios.items()}, **longs}
    print(f"# {len(audios)} clips ({sum(len(a) for a in audios.values()) / 16000:.1f} s), "
          "long-form: " + ", ".join(f"{n} {len(a) / 16000:.1f} s" for n, (a, _) in longs.items()))
    print("| model | decoding | layout | WER short % | WER long-form % | WER all % | "
          "errors / words | texts = other layout |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        names = [n for n in items if model != "tiny.en" or not n.startswith(NON_ENGLISH)]
        for beam in args.beams:
            texts = {}
            for padding in MEL_PADDINGS:
                t0 = time.perf_counter()
                texts[padding] = dict(zip(names, run(model, beam, padding,
                                                     [items[n][0] for n in names]), strict=True))
                print(f"# {model} beam {beam} {padding}: {time.perf_counter() - t0:.0f} s")
            same = sum(texts["silence"][n] == texts["zeros"][n] for n in names)
            for padding in MEL_PADDINGS:
                err = {n: word_errors(items[n][1], texts[padding][n]) for n in names}

                def wer(keys: list[str], err: dict = err) -> str:
                    e, w = (sum(err[k][i] for k in keys) for i in (0, 1))
                    return f"{100 * e / max(w, 1):.1f}"

                short = [n for n in names if n not in longs]
                total = (sum(e for e, _ in err.values()), sum(w for _, w in err.values()))
                print(f"| {model} | {'greedy' if beam == 1 else f'beam {beam}'} | {padding} | "
                      f"{wer(short)} ({len(short)}) | {wer(list(longs))} ({len(longs)}) | "
                      f"{wer(names)} | {total[0]} / {total[1]} | {same}/{len(names)} |",
                      flush=True)
            if args.texts:
                for n in names:
                    if texts["silence"][n] != texts["zeros"][n]:
                        print(f"#   {n}: silence {texts['silence'][n]!r}\n"
                              f"#   {' ' * len(n)}  zeros   {texts['zeros'][n]!r}")


if __name__ == "__main__":
    main()
